"""PDD (Guo et al. 2023): training-free perturbations that push every biased feature's z under a threshold.

``zvalue`` (Eq. 1, Appendix C), ``masking`` (section 3.3.1, Table 9), ``fill`` (prompt-based filling with
any masked LM, section 3.3.2), ``teacher`` (confidence filtering), ``hypothesis_folds`` (the
hypothesis-only feature's fold models), ``algorithm`` (Algorithm 1), ``run`` (the walk, resumable), ``params``
(the step's parameters, declared once), ``step`` (the recipe step, reports, outputs).
"""
