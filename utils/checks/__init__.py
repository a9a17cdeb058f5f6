"""Students' self-checks (see _common.py for the conventions). ``utils.checks.check_NAME``."""
from ._common import CheckFailed  # noqa: F401
from .stage0 import *  # noqa: F401,F403
from .stage1 import *  # noqa: F401,F403
from .stage2 import *  # noqa: F401,F403
from .stage3 import *  # noqa: F401,F403
from .stage4 import *  # noqa: F401,F403
from .stage5 import *  # noqa: F401,F403
