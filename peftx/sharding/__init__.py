"""Sharded PEFT with JAX's own SPMD: a mesh, rules that say how each array is split,
placing a model (adapters follow their base weights), and runs of several processes."""

from ._hosts import (
    agree as agree,
    exit_run as exit_run,
    initialize_distributed as initialize_distributed,
    lost_process as lost_process,
    own_rows as own_rows,
    process_rows as process_rows,
    spread_over_processes as spread_over_processes,
    to_host as to_host,
    wait_for_all as wait_for_all,
    wait_for_writer as wait_for_writer,
    writes_files as writes_files,
)
from ._mesh import (
    AXES as AXES,
    BATCH_AXES as BATCH_AXES,
    batch_parts as batch_parts,
    make_mesh as make_mesh,
)
from ._place import (
    batch_sharding as batch_sharding,
    partition_specs as partition_specs,
    placed_like as placed_like,
    placement_line as placement_line,
    shard as shard,
)
from ._rules import PRESETS as PRESETS, Rules as Rules
