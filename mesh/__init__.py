"""Named mesh, logical->physical rules, shardings and distributed start-up."""

from meshrl.mesh.distributed import initialize_distributed
from meshrl.mesh.mesh import (
    MeshShapeError,
    check_process_rows,
    create_mesh,
    describe_mesh,
    resolve_shapes,
)
from meshrl.mesh.rules import (
    Role,
    Rules,
    describe_rules,
    logical_to_sharding,
    logical_to_spec,
    rules_for,
    sample_rules,
    train_rules,
    tree_shardings,
)

__all__ = [
    "MeshShapeError", "Role", "Rules", "check_process_rows", "create_mesh", "describe_mesh", "describe_rules",
    "initialize_distributed", "logical_to_sharding", "logical_to_spec", "resolve_shapes",
    "rules_for", "sample_rules", "train_rules", "tree_shardings",
]
