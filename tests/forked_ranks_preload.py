"""Imported once by tests/forked_ranks.py's forkserver: what a rank of train.py imports
before its first step, so that each forked rank starts with it already loaded."""

import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401

from meshtrain import train  # noqa: F401
from meshtrain.training import recipe  # noqa: F401
