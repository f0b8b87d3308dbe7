"""Imported once by tests/forked_ranks.py's forkserver: what a rank imports before its
first step, so that each forked rank starts with it already loaded. torch with
torch._dynamo is about 6 CPU-seconds; transformers' modelling machinery (which the
[model] name = "hf" ranks build on, and which pulls in torchao, the float8 ranks')
about 5 more."""

import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401

from meshtrain import train  # noqa: F401
from meshtrain.training import recipe  # noqa: F401

try:  # extras ("meshtrain[hf]", "meshtrain[float8]"): the ranks that use them import them
    import torchao.float8  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
except ImportError:
    pass
