"""AFLite (Le Bras et al. 2020): ``algorithm`` (Algorithm 1 and the predictability scores), ``ensemble``
(the batched linear classifiers), ``step`` (the recipe step and dataset filter), ``report`` (card section,
plot, output files)."""
