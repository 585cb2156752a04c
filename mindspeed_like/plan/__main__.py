"""``python -m mindspeed_like.plan``: the same as ``mindspeed-like plan``."""

import sys

from mindspeed_like.plan.cli import main

sys.exit(main())
