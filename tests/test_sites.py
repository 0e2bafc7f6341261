"""The site router (``slimact.sites``): entering it once, for one model."""

import warnings

import pytest
import torch.nn as nn

from slimact import sites


def test_tracking_another_model_inside_the_router_warns():
    """A model run inside the router entered for another one is not tracked: say so."""
    outer, inner = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))
    with sites.tracking(outer):
        with pytest.warns(RuntimeWarning, match="already tracking another model"):
            with sites.tracking(inner):
                pass
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with sites.tracking(outer[0]):  # a part of the tracked model: fine
                pass
