"""The integrations' optimizer folders are complete or invisible, and checked before they are read.

One torchrun run (2 gloo ranks, `tests/runtime/integrations_checkpoint_driver.py`), a bf16 model
(fp32 master weights), for `CanzonaAccelerator.save_state` / `load_state` and `CanzonaTrainer`:
a save killed before its rename leaves the previous optimizer folder as it was (and loadable); a
model/optimizer mix (the framework's model files written, the optimizer's not) is refused, and a
save resumed whole is not; a damaged optimizer file is one error line; a folder of the older
integrations (plain `dcp.save`, no manifest) loads, and saving over it is refused.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.launchers import driver_results, scenario  # noqa: E402
from tests.runtime import integrations_checkpoint_driver as driver  # noqa: E402

pytestmark = pytest.mark.distributed  # one torchrun of gloo ranks

DP = 2
MIX = "CheckpointError: the model's weights differ from those the optimizer checkpoint was saved with"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return driver_results(DP, driver.__file__, tmp_path_factory.mktemp("integrations_checkpoint"), timeout=600)


def one_line(results: list[dict], key: str, start: str) -> None:
    """The same one-line error, starting with `start`, on every rank (after the failing rank's
    number, where the ranks found different things)."""
    texts = {r[key] for r in results}
    assert len(texts) == 1, texts
    text = re.sub(r"^CheckpointError: rank \d+: ", "CheckpointError: ", texts.pop())
    assert text.startswith(start) and "\n" not in text, text


@pytest.mark.parametrize("name", ["accelerate", "trainer"])
def test_a_killed_save_into_a_reused_folder_keeps_the_previous_optimizer_state(ranks, name):
    results = scenario(ranks, name)
    one_line(results, "killed", "CheckpointError: ")
    assert "killed before the rename" in results[0]["killed"]
    for r in results:
        assert r["same manifest"]  # verified against its manifest: the previous save's files, whole
        assert not [n for n in r["after kill"] if ".tmp-" in n or ".old-" in n], r["after kill"]
    if name == "accelerate":
        assert all(r["previous intact"] for r in results)
    else:  # the Trainer's checkpoint-1 resumes as the straight run went on
        assert all(r["resumed exactly"] for r in results)


@pytest.mark.parametrize("name", ["accelerate", "trainer"])
def test_model_files_beside_another_saves_optimizer_state_are_refused(ranks, name):
    results = scenario(ranks, name)
    one_line(results, "mix", MIX)
    assert "different saves" in results[0]["mix"] and "fp32 master weights" in results[0]["mix"]
    if name == "accelerate":
        assert all(r["mix changed nothing"] for r in results)


def test_a_whole_save_resumes_exactly_and_is_not_refused(ranks):
    for r in scenario(ranks, "accelerate"):
        assert r["resume"] == "no error" and r["resumed exactly"]
        assert r["fresh resume"] == "no error" and r["fresh resumed exactly"]


@pytest.mark.parametrize("name", ["accelerate", "trainer"])
def test_a_damaged_optimizer_file_is_one_error_line(ranks, name):
    results = scenario(ranks, name)
    one_line(results, "damaged", "CheckpointError: ")
    assert "differs from the manifest" in results[0]["damaged"]


@pytest.mark.parametrize("name", ["accelerate", "trainer"])
def test_an_older_folder_without_manifest_loads_and_is_not_saved_over(ranks, name):
    results = scenario(ranks, name)
    for r in results:
        assert r["legacy resumed exactly"] if name == "trainer" else (r["legacy"] == "no error"
                                                                      and r["legacy loaded exactly"])
        assert r["legacy untouched"]
    one_line(results, "save over legacy", "CheckpointError: ")
    assert "older canzona" in results[0]["save over legacy"] and "move it aside" in results[0]["save over legacy"]
    if name == "trainer":  # the Trainer's own save refuses before it writes the step's model files
        one_line(results, "trainer save over legacy", "CheckpointError: ")
        assert "now holds this step's model files" not in results[0]["trainer save over legacy"]
        assert all(r["model files untouched"] for r in results)


def test_the_trainer_resumes_from_the_latest_whole_checkpoint(ranks):
    """`resume_from_checkpoint=True` skips the folders of saves killed midway (transformers picks
    the highest step and fails in its model, optimizer or trainer_state.json loading); none whole:
    one error line on every rank, naming them."""
    results = scenario(ranks, "trainer")
    for r in results:
        assert r["latest resume"] == "no error" and r["latest resumed exactly"], r["latest resume"]
    one_line(results, "none whole", "CheckpointError: resume_from_checkpoint=True: no whole checkpoint in ")
    one_line(results, "named partial", "CheckpointError: ")
    assert "checkpoint-2 is not a whole CanzonaTrainer checkpoint (no trainer_state.json" in results[0]["named partial"]
    assert all(r["legacy latest resumed exactly"] for r in results)  # an older canzona's folder counts
    assert "checkpoint-3 (no canzona_optimizer/manifest.json)" in results[0]["none whole"]


def test_accelerate_load_state_takes_the_latest_whole_automatic_checkpoint(ranks):
    """`load_state()` under automatic checkpoint naming after a save_state killed midway: accelerate
    takes the highest number; the integration the latest folder whose optimizer folders are in."""
    results = scenario(ranks, "accelerate automatic")
    for r in results:
        assert "killed before the rename" in r["killed"]
        assert r["folders"] == ["checkpoint_1", "checkpoint_2"], r["folders"]  # total_limit=2 rotated checkpoint_0
        assert r["latest"] == "no error" and r["latest loaded exactly"], r["latest"]
        assert r["legacy latest"] == "no error" and r["legacy latest loaded exactly"], r["legacy latest"]
        assert r["named"].startswith("CanzonaError: ") and "holds no canzona_optimizer_0/" in r["named"], r["named"]
        assert r["named changed nothing"]
