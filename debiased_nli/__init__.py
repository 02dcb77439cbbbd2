"""debiased-nli: build debiased versions of NLU datasets and publish them on the Hugging Face Hub."""
__version__ = "0.1.0"
