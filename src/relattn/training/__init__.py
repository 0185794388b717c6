"""The training application: the byte-level LM built from the module (:mod:`.model`), its data, the
training recipe and its checkpoints, evaluation, reports and plots, and the ``relattn train`` and
``relattn compare`` commands. Built on the library; the library never imports it."""

from .model import TransformerConfig, TransformerEncoder, TransformerLM
from .options import TrainOptions
from .recipe import TrainingRecipe
from .train import train

__all__ = ["TrainOptions", "TrainingRecipe", "TransformerConfig", "TransformerEncoder", "TransformerLM", "train"]
