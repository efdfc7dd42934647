"""pytest plugin (``-p _genlm_alias_plugin``): genlm-backend's test suite runs against genback.

Loaded before the suite's ``conftest.py`` is imported, it makes ``import genlm.backend`` resolve
to genback (:func:`genback.compat.alias_genlm_backend`) and pins torch to one thread.
"""

import torch

import genback.compat

torch.set_num_threads(1)
genback.compat.alias_genlm_backend()
