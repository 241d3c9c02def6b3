"""Every configuration object shares lipdp.foundation.config.Config: frozen, validated, and one
serialisation (a JSON-able dict whose round trip gives an equal object; ``coerce``
accepts the object, its dict, or ``None`` where the setting is optional)."""

import dataclasses
import json

import pytest

from lipdp.accounting.tuning_cost import RandomSearch
from lipdp.clipless.dynamic import DynamicClippingSpec
from lipdp.clipped.model import Clipping, SharpnessAscent
from lipdp.core.adversarial import PGD
from lipdp.core.private_model import DPParameters
from lipdp.foundation.config import Config
from lipdp.foundation.metadata import DatasetMetadata

EXAMPLES = {
    "DPParameters": DPParameters(
        "global", 1.5, 1e-5,
        dynamic_clipping=DynamicClippingSpec("laplace", epsilon=0.1),
        hyperparameter_search=RandomSearch(3.0),
    ),
    "DatasetMetadata": DatasetMetadata(
        input_shape=(8, 8, 1), nb_classes=10, nb_samples_train=1000, batch_size=50,
        class_names=["a"], notes=["scaled on public data"], sampling="poisson",
    ),
    "Clipping": Clipping("per-layer", 2.0, layer_shares=(1.0, 2.0)),
    "SharpnessAscent": SharpnessAscent("bam", 0.05),
    "PGD": PGD(0.3, steps=3, clip_values=(0.0, 1.0), mix=0.5),
    "RandomSearch": RandomSearch(4.0, shape=0.5),
    "DynamicClippingSpec": DynamicClippingSpec(
        "quantiles", noise_multiplier=2.0, sampling_rate=0.1
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", EXAMPLES)
def test_round_trip_through_json_gives_an_equal_object(name):
    config = EXAMPLES[name]
    assert isinstance(config, Config)
    plain = json.loads(json.dumps(config.to_config()))  # JSON-able as it is
    again = type(config).from_config(plain)
    assert again == config
    assert type(config).coerce(plain) == config
    assert type(config).coerce(config) is config


@pytest.mark.parametrize("name", EXAMPLES)
def test_configurations_are_frozen(name):
    config = EXAMPLES[name]
    field = dataclasses.fields(config)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, field, getattr(config, field))


def test_coerce_takes_none_where_optional_and_names_the_argument_otherwise():
    assert PGD.coerce(None) is None and RandomSearch.coerce(None) is None
    with pytest.raises(TypeError, match="clipping must be a Clipping or its config dict"):
        Clipping.coerce(None)
    with pytest.raises(TypeError, match="adversarial must be a PGD or its config dict"):
        PGD.coerce("pgd")


def test_validation_runs_on_the_dict_path_too():
    config = EXAMPLES["Clipping"].to_config()
    assert config["layer_shares"] == [1.0, 2.0]  # a list in the dict, a tuple again after
    assert Clipping.from_config(config).layer_shares == (1.0, 2.0)
    with pytest.raises(ValueError, match="clip_norm"):
        Clipping.from_config({**config, "clip_norm": -1.0})
