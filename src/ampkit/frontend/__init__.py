"""apex.amp's front end on ampkit: ``initialize``, ``scale_loss``, ``master_params`` and
the amp state dict (``import ampkit as amp`` runs apex.amp code).

- ``initialize.py``: apex's keywords resolved to a :class:`~ampkit.policy.Policy`, applied
  through ``ampkit.apply`` (the seam ``ampkit bench``/``train`` use too);
- ``scale_loss.py``: the loss-scaling context manager and its overflow handling;
- ``state.py``: ``master_params``, ``state_dict``/``load_state_dict`` and apex's
  ``_amp_state`` as public apex clients read it.

The only process-wide state is ``ampkit._state``'s active initialize.
"""

from .initialize import initialize
from .scale_loss import scale_loss
from .state import _amp_state, load_state_dict, master_params, state_dict

__all__ = ["initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
           "_amp_state"]
