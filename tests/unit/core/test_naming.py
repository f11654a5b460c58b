"""Checkpoint names: templates with metrics and counters, parsed back; unsafe names made safe."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_manager import CheckpointConfig
from checkpoint_manager.core.naming import format_name, parse_name, sanitize_name, validate_template
from checkpoint_manager.storage.local import LocalStorage

NEMO = "megatron_gpt--val_loss=0.432-step=1000-consumed_samples=32000.0"
NEMO_TEMPLATE = "megatron_gpt--val_loss={val_loss:.3f}-step={step}-consumed_samples={consumed_samples}"
METRIC_TEMPLATE = "step={step:08d}-val_loss={val_loss:.4f}"


def test_metric_template_is_the_directory_name_and_parses_back() -> None:
    name = format_name(METRIC_TEMPLATE, step=1200, metrics={"val_loss": 0.43219}, fields={"epoch": 3})
    assert name == "step=00001200-val_loss=0.4322"
    parsed = parse_name(name, METRIC_TEMPLATE)
    assert parsed == {"step": 1200, "val_loss": 0.4322}
    assert type(parsed["step"]) is int and type(parsed["val_loss"]) is float


def test_nemo_style_name_parses_without_and_with_its_template() -> None:
    expected = {"val_loss": 0.432, "step": 1000, "consumed_samples": 32000.0}
    assert parse_name(NEMO) == expected
    assert parse_name(NEMO, NEMO_TEMPLATE) == expected
    assert type(parse_name(NEMO)["step"]) is int
    # and our own writer produces exactly that name from that template
    written = format_name(NEMO_TEMPLATE, step=1000, metrics={"val_loss": 0.4321}, fields={"consumed_samples": 32000.0})
    assert written == NEMO


def test_generic_parse_reads_negative_and_exponent_values_and_the_default_name() -> None:
    assert parse_name("loss=-0.5-lr=1e-05-step=3") == {"loss": -0.5, "lr": 1e-05, "step": 3}
    assert parse_name("step_00000010") == {"step": 10}
    assert parse_name("step_00000010", "step_{step:08d}") == {"step": 10}
    assert parse_name("run-tag=baseline-step=7") == {"tag": "baseline", "step": 7}
    assert parse_name("no fields here") == {}


def test_collision_suffix_is_ignored_when_parsing() -> None:
    assert parse_name("step=00000010-val_loss=0.5000-v2", METRIC_TEMPLATE) == {"step": 10, "val_loss": 0.5}
    assert parse_name("step=10-v3") == {"step": 10}


def test_missing_metric_is_written_as_nan_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    template = "s{step}-acc={acc:.2f}-once"
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        first = format_name(template, step=5, metrics={}, fields={})
        format_name(template, step=6, metrics={}, fields={})
    assert first == "s5-acc=nan-once"
    warnings = [r for r in caplog.records if "acc" in r.getMessage()]
    assert len(warnings) == 1 and "written as 'nan'" in warnings[0].getMessage()
    parsed = parse_name(first, template)
    assert parsed["step"] == 5 and math.isnan(float(parsed["acc"]))


def test_counters_and_percent_specs_round_trip() -> None:
    template = "e{epoch:03d}-tokens={tokens:d}-acc={acc:.1%}"
    name = format_name(template, step=1, metrics={"acc": 0.875}, fields={"epoch": 4, "tokens": 123456})
    assert name == "e004-tokens=123456-acc=87.5_"  # "%" is not path-safe
    assert parse_name(name, template) == {"epoch": 4, "tokens": 123456, "acc": 0.875}


def test_unsafe_characters_are_replaced() -> None:
    name = format_name("run {tag}: step {step}", step=3, metrics={}, fields={"tag": "a/b\\c*?<>|\"'"})
    assert name == "run_a_b_c" + "_" * 7 + "__step_3"  # each unsafe character became one "_"
    assert parse_name(name, "run {tag}: step {step}") == {"tag": "a_b_c" + "_" * 7, "step": 3}


def test_sanitize_name_edge_cases() -> None:
    assert sanitize_name("..hidden..") == "hidden"
    assert sanitize_name("latest") == "latest_"  # never collides with a pointer file
    assert sanitize_name("best") == "best_"
    assert sanitize_name("ünïcode") == "_n_code"
    long = sanitize_name("x" * 300)
    assert len(long) == 200 and long != sanitize_name("x" * 301)
    with pytest.raises(ValueError, match="empty once made safe"):
        sanitize_name("...")


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("checkpoint", "must contain a field"),
        ("{}", "positional fields are not allowed"),
        ("{0}", "positional fields are not allowed"),
        ("{metrics.loss}", "attribute or index access"),
        ("{a[0]}", "attribute or index access"),
        ("{step:{width}}", "nested fields"),
        ("runs/{step}", "must not contain path separators"),
        ("{step", "is malformed"),
    ],
)
def test_bad_templates_are_rejected(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_template(template)


def test_config_rejects_a_bad_template_and_names_the_field() -> None:
    with pytest.raises(ValueError, match="name_template 'checkpoint' must contain a field"):
        CheckpointConfig(save_dir="x", name_template="checkpoint")


def test_a_name_that_does_not_fit_the_template_is_an_error() -> None:
    with pytest.raises(ValueError, match="does not match name_template"):
        parse_name("step_00000010", METRIC_TEMPLATE)
    with pytest.raises(ValueError, match="does not match"):
        parse_name("step=abc-val_loss=0.1", METRIC_TEMPLATE)


def test_a_name_collision_never_overwrites_a_committed_checkpoint(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path, fsync=False)
    paths = []
    for payload in (b"first", b"second", b"third"):
        pending = storage.new_pending("step=10")
        (pending / "data").write_bytes(payload)
        paths.append(storage.commit(pending, "step=10"))
    assert [p.name for p in paths] == ["step=10", "step=10-v2", "step=10-v3"]
    assert [(p / "data").read_bytes() for p in paths] == [b"first", b"second", b"third"]
    assert parse_name(paths[2].name, "step={step}") == {"step": 10}


finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6)


@settings(max_examples=200, deadline=None)
@given(step=st.integers(min_value=0, max_value=10**9), loss=finite | st.sampled_from([math.inf, -math.inf]),
       samples=st.integers(min_value=0, max_value=10**12))
def test_templates_round_trip(step: int, loss: float, samples: int) -> None:
    name = format_name(METRIC_TEMPLATE, step=step, metrics={"val_loss": loss}, fields={})
    parsed = parse_name(name, METRIC_TEMPLATE)
    assert parsed["step"] == step
    assert parsed["val_loss"] == pytest.approx(loss, abs=5.1e-5) or parsed["val_loss"] == loss

    nemo = format_name(NEMO_TEMPLATE, step=step, metrics={"val_loss": loss}, fields={"consumed_samples": float(samples)})
    for got in (parse_name(nemo, NEMO_TEMPLATE), parse_name(nemo)):
        assert got["step"] == step and got["consumed_samples"] == float(samples)
        assert got["val_loss"] == pytest.approx(loss, abs=5.1e-4) or got["val_loss"] == loss


@settings(max_examples=200, deadline=None)
@given(tag=st.text(min_size=1, max_size=40), step=st.integers(min_value=0, max_value=10**6))
def test_any_text_becomes_one_safe_path_component(tag: str, step: int) -> None:
    name = format_name("{tag}-step={step}", step=step, metrics={}, fields={"tag": tag})
    assert name and len(name) <= 200
    assert all(c.isascii() and (c.isalnum() or c in "._=+-") for c in name)
    assert not name.startswith(".") and name not in ("latest", "best")
    if len(name) < 200:
        assert parse_name(name)["step"] == step
