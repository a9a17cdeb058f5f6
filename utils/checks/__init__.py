"""Students' self-checks (see _common.py for the conventions). ``utils.checks.check_NAME``."""

from ._common import CheckFailed, check_prediction  # noqa: F401
from .ddp import *  # noqa: F401,F403
from .ddp_script import *  # noqa: F401,F403
from .environment import *  # noqa: F401,F403
from .gd_sgd import *  # noqa: F401,F403
from .large_batch import *  # noqa: F401,F403
from .model_parallel import *  # noqa: F401,F403
from .profiling import *  # noqa: F401,F403
from .throughput import *  # noqa: F401,F403
from .transformer import *  # noqa: F401,F403
