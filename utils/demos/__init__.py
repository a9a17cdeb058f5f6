"""The experiments the notebooks launch, apart from the mechanisms they measure.

Each module holds the worker (run on every rank by ``utils.parallel.launch``) of one notebook
experiment and the small helpers it needs. The mechanisms themselves (process groups, the ring,
sharding, tensor and pipeline parallelism) live in :mod:`utils.parallel`, which never imports
from here. A notebook shows a worker's code with :func:`show_source` before launching it.

===================== ==================================================================
``collectives_demo`` notebook 03: the four collectives, the ring timed against all_reduce
``ddp_demo``         notebook 03: DDP by hand and with DDP, Join, no_sync, buckets and overlap
``hang_demo``        notebook 03: uneven inputs hang; a collective timeout ends it
``plain_serial``     notebook 03: the serial script in plain PyTorch (run with ``python -m``)
``plain_ddp``        notebook 03: the same script made data-parallel (run with ``torchrun -m``)
``batchnorm_demo``   notebook 03: per-rank BatchNorm statistics against synchronised ones
``dataparallel_demo`` notebook 03: threads of one process under ``nn.DataParallel``
``shard_demo``       notebook 05: DDP, ZeRO-1 and FSDP2 trained side by side, bytes and traffic
``tp_demo``          notebook 05: the Megatron split by hand and with parallelize_module
``pp_demo``          notebook 05: GPipe by hand and the library's GPipe/1F1B schedules
``gpt_tp_demo``      notebook 07: the GPT's blocks under tensor and sequence parallelism
``gpt_pp_demo``      notebook 07: the GPT in pipeline stages, GPipe and 1F1B
``gpt_ddp``          notebook 07: the GPT under DDP or FSDP2 per block (run with ``torchrun -m``)
===================== ==================================================================
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from IPython.display import Code

__all__ = ["show_source"]


def show_source(*objs: Any) -> Code | None:
    """The source of each module, function or class, highlighted as one Python block in a notebook
    (plain text elsewhere): how a notebook shows the worker it is about to launch."""
    text = "\n\n".join(inspect.getsource(o).rstrip() for o in objs) + "\n"
    try:
        from IPython.display import Code
    except ImportError:  # outside IPython: plain text
        print(text)
        return None
    return Code(text, language="python")
