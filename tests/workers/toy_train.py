"""train.py with the toy family of tests/toy_family.py registered first (torchrun worker)."""

import sys

from meshtrain import train
from meshtrain.models import registry
from tests.toy_family import FAMILY

registry.register(FAMILY)

sys.exit(train.run(sys.argv[1:]))
