"""The compiler driver: the pipeline from a traced graph to a runnable program (NOTE
[pipeline] in pipeline.py) and the record of its stages (stages.py)."""
from .pipeline import (GRAPH_STAGES, LOOP_STAGES, Stage, compiled, compiled_body, generated,
                       scheduled, settings_key, simplified, snapshot, training)
from .stages import Stages

__all__ = ["GRAPH_STAGES", "LOOP_STAGES", "Stage", "Stages", "compiled", "compiled_body",
           "generated", "scheduled", "settings_key", "simplified", "snapshot", "training"]
