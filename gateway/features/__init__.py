"""Request features: model resolution, exact tokens (tokenizer + chat template), block keys."""

from gateway.features.budgets import EncodeSettings
from gateway.features.featurizer import FeatureInfo, Featurizer
from gateway.features.tokenizer_files import FeatureConfigError

__all__ = ["EncodeSettings", "FeatureConfigError", "FeatureInfo", "Featurizer"]
