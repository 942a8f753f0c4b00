"""Which models the connector can extract from: vLLM's class must return auxiliary hidden states
(SupportsEagle3), decided from vLLM's model registry before anything loads; a model whose class
has none is named in one line by `launch`, `doctor` and the connector's startup.

Run: python -m pytest tests/test_model_support.py -q   (CPU; the connector's check needs the
harness platform)
"""

from __future__ import annotations

import harness
import pytest
from tiny_models import FAMILIES, write_config

from vllm_gdn_hs.cli import launch
from vllm_gdn_hs.cli.doctor import model_checks
from vllm_gdn_hs.model_support import aux_outputs_problem, has_aux_outputs, registered_classes
from vllm_gdn_hs.names import CONNECTOR_NAME

# Hybrids in vLLM 0.34.0 without aux outputs, with what their config.json needs to be read.
REFUSED = {
    "FalconH1ForCausalLM": ("falcon_h1", "vllm.model_executor.models.falcon_h1"),
    "GraniteMoeHybridForCausalLM": (
        "granitemoehybrid",
        "vllm.model_executor.models.granitemoehybrid",
    ),
}


def _refused_model(tmp_path, arch: str) -> str:
    model_type = REFUSED[arch][0]
    return write_config(
        str(tmp_path / model_type),
        dict(architectures=[arch], model_type=model_type, num_hidden_layers=8, hidden_size=256),
    )


def _line(arch: str) -> str:
    """The one line every entry point gives for ``arch``."""
    return (
        f"{arch} cannot be extracted from: vLLM's {arch} ({REFUSED[arch][1]}) returns no "
        "auxiliary hidden states (it does not implement SupportsEagle3), so no layer can be taken "
        "out of it. Extract from a model vLLM serves with them (Qwen3.5/3.6, Qwen3.5-MoE, "
        "Qwen3-Next, Nemotron-H, most dense models; docs/options.md, 'Supported models'), or add "
        "EagleModelMixin to that class in vLLM"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_aux_outputs(family):
    (arch,) = FAMILIES[family]()["architectures"]
    assert arch in registered_classes()
    assert has_aux_outputs(arch) is True
    assert aux_outputs_problem([arch]) is None


def test_registry_answers_for_dense_and_other_hybrids():
    assert has_aux_outputs("Qwen3ForCausalLM") is has_aux_outputs("LlamaForCausalLM") is True
    for arch in ("JambaForCausalLM", "Zamba2ForCausalLM", "Lfm2ForCausalLM", "GPT2LMHeadModel"):
        assert has_aux_outputs(arch) is False, arch
    assert has_aux_outputs("NoSuchForCausalLM") is None  # a plugin's: left to the runner's check
    assert aux_outputs_problem(["NoSuchForCausalLM"]) is None


@pytest.mark.parametrize("arch", REFUSED)
def test_launch_names_the_class_in_one_line(tmp_path, capsys, arch):
    assert launch.main([_refused_model(tmp_path, arch), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {_line(arch)}\n"


@pytest.mark.parametrize("arch", REFUSED)
def test_doctor_names_the_class_in_one_line(tmp_path, arch):
    rows, _ = model_checks(_refused_model(tmp_path, arch))
    rows = {item: (value, problem) for item, value, problem in rows}
    assert rows["aux hidden states in vLLM"] == ("no", _line(arch))


@pytest.mark.parametrize("arch", REFUSED)
def test_connector_startup_names_the_class_in_one_line(hybrid_model, tmp_path, arch):
    """The connector's check on a real engine config, its architecture renamed: vLLM would
    inspect a Falcon-H1 class in a subprocess (tens of seconds) to build the config itself."""
    from vllm_gdn_hs.connector.checks import validate_vllm_config

    cfg = harness.engine_config(hybrid_model, storage=str(tmp_path))
    cfg.model_config.model_arch_config.architectures = [arch]
    with pytest.raises(ValueError) as e:
        validate_vllm_config(cfg)
    assert str(e.value) == f"{CONNECTOR_NAME}: {_line(arch)}"
