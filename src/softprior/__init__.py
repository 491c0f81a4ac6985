"""softprior: annealable soft-prior Transformers and circuit-removability experiments
(after "Training Trajectories Determine Circuit Removability in Annealable Soft-Prior Transformers")."""

from .config import RunConfig, make_run_config
from .model import ModelConfig, SoftPriorTransformer, model_preset
from .paths import GateConfig, PathConfig, get_path, register_path
from .runner import run
from .store import RunStore, load_results
from .train import train

__all__ = ["RunConfig", "make_run_config", "ModelConfig", "SoftPriorTransformer", "model_preset", "GateConfig",
           "PathConfig", "get_path", "register_path", "run", "RunStore", "load_results", "train"]
__version__ = "0.1.0"
