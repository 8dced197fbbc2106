"""``python -m distributed_ext.bench`` (and ``torchrun ... -m distributed_ext.bench``)."""

import sys

from distributed_ext.bench.cli import main

sys.exit(main())
