"""config_from_json: every config option given as JSON (speculative, KV transfer, pooler,
structured outputs) reads dicts and JSON text alike and words its errors the same way."""

import pytest

from workbench.config import KVTransferConfig, SpeculativeConfig, StructuredOutputsConfig
from workbench.pooling.config import PoolerConfig


@pytest.mark.parametrize("cls, name", [
    (SpeculativeConfig, "speculative_config"), (KVTransferConfig, "kv_transfer_config"),
    (PoolerConfig, "pooler_config"), (StructuredOutputsConfig, "structured_outputs_config")])
def test_every_json_option_names_itself_in_its_errors(cls, name):
    with pytest.raises(ValueError, match=rf"^{name} must be a JSON object, got '\{{x'"):
        cls.parse("{x")
    with pytest.raises(ValueError, match=rf"^{name} must be a dict or a JSON object, got list"):
        cls.parse("[1]")
    with pytest.raises(ValueError, match=rf"^{name}: unknown keys \['nope'\]; known: \["):
        cls.parse({"nope": 1})


def test_a_dict_and_its_json_text_give_the_same_config():
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 3}') == SpeculativeConfig.parse(
        {"num_speculative_tokens": 3})
    assert PoolerConfig.parse('{"pooling_type": "MEAN"}') == PoolerConfig.parse({"pooling_type": "MEAN"})
