"""What a training step minimises, built once per run: `Objective` and its implementations."""

from tuneforge.objective.base import LossTerms, Objective
from tuneforge.objective.cross_entropy import CrossEntropy
from tuneforge.objective.forward import TokenForward

__all__ = ["CrossEntropy", "LossTerms", "Objective", "TokenForward"]
