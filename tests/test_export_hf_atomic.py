"""``checkpoint.export_hf`` survives a signal and a full disk (issue 40 point 4): the export is
written into ``<target>.partial`` and renamed into place when complete; an interrupted or
failed export removes the partial directory, says so in one line, and the same command
(``checkpoint.resume=auto``) then exports the saved checkpoint. The target is checked
before training and again before the export.

The SIGTERM at TP=2 is sent to a real torchrun job and the same command is run again (as
``train()`` on 2 gloo ranks: the path launch/train.py runs, bit for bit); the SIGINT and
the full disk (a file-size limit) run in this process and check the ExportError that
launch/train.py prints as its one line."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

import transformers  # noqa: E402
from transformers import modeling_utils  # noqa: E402 - binds safetensors' save_file as safe_save_file

from tp_fuse.launch.api import train  # noqa: E402
from tp_fuse.launch.checkpoint import hf_export  # noqa: E402
from tp_fuse.launch.checkpoint.hf_export import ExportError, check_export_target, partial_path  # noqa: E402
from tp_fuse.launch.checkpoint.manager import CheckpointError  # noqa: E402
from tp_fuse.launch.config import CONFIG_DIR  # noqa: E402
from tp_fuse.launch.config_errors import precheck  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from test_launch_hf import _model_dir  # noqa: E402
from test_launch_train import ROOT, torchrun_command  # noqa: E402

# Loaded by every Python process started with this directory on PYTHONPATH: with
# TP_FUSE_TEST_PAUSE_EXPORT set, the export's safetensors write (transformers binds
# safetensors.torch.save_file when it is imported, after this) first marks that it has
# started, then waits: the test signals the job while it is inside the export.
_SITECUSTOMIZE = '''
import os
if os.environ.get("TP_FUSE_TEST_PAUSE_EXPORT"):
    import time
    import safetensors.torch as _st
    _real = _st.save_file
    def save_file(*args, **kwargs):
        open(os.environ["TP_FUSE_TEST_PAUSE_EXPORT"], "w").close()
        time.sleep(120)
        return _real(*args, **kwargs)
    _st.save_file = save_file
'''


def _args(tmp_path, export) -> list[str]:
    return ["+model=hf", f"model.path={tmp_path / 'model'}", "data.seq_len=32", "trainer.global_batch_size=4",
            "trainer.micro_batch_size=4", "trainer.max_steps=2", "trainer.log_interval=1", "trainer.val_interval=0",
            "logger=none", "trainer.progress=false", "checkpoint.save_final=true", "checkpoint.resume=auto",
            f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.export_hf={export}"]


@pytest.fixture
def model(tmp_path):
    _model_dir(tmp_path / "model", weights=False)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return hook


def _exported(path) -> bool:
    return sorted(os.listdir(path))[:2] == ["config.json", "generation_config.json"] and \
        os.path.getsize(os.path.join(path, "model.safetensors")) > 0


def _train_on_two_ranks(rank: int, world_size: int, args: list[str], run_dir: str) -> bool:
    """One rank of a 2-rank launcher run (inside run_distributed): is the run already complete?"""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    return train(args, run_dir).already_complete


@pytest.mark.multirank
def test_sigterm_during_a_tp2_export_then_the_same_command_completes_it(tmp_path, model, capfd):
    export = tmp_path / "hf"
    cmd, env = torchrun_command([*_args(tmp_path, export), "parallel.tp=2", f"hydra.run.dir={tmp_path / 'run'}"],
                                env={"PYTHONPATH": f"{model}{os.pathsep}{ROOT}"})
    marker = tmp_path / "export_started"
    proc = subprocess.Popen(cmd, env={**env, "TP_FUSE_TEST_PAUSE_EXPORT": str(marker)}, cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate(timeout=60)
    assert os.path.isdir(partial_path(str(export))) and not export.exists()  # written beside, not in place
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    partial = partial_path(str(export))
    assert (f"[tp-fuse] error: checkpoint.export_hf: writing {export} failed: interrupted by SIGTERM; removed the "
            f"partial {partial}; nothing was written to {export}; the checkpoint ") in err, err[-3000:]
    assert "is kept: run the same command with checkpoint.resume=auto to export it" in err, err[-3000:]
    assert not export.exists() and not os.path.exists(partial_path(str(export)))
    assert "Traceback" not in err.split("[tp-fuse] error: checkpoint.export_hf")[0][-2000:], err[-3000:]
    capfd.readouterr()
    # The same command again, as launch/train.py's train() on 2 gloo ranks (a torchrun start costs ~20 CPU-s more).
    again = run_distributed(2, _train_on_two_ranks, [*_args(tmp_path, export), "parallel.tp=2"],
                            str(tmp_path / "run"), timeout=300)
    err = capfd.readouterr().err
    assert again == [True, True] and "the run is already complete" in err and _exported(export), err[-3000:]
    assert not os.path.exists(partial_path(str(export)))


def test_sigint_during_an_export_is_one_line_naming_the_checkpoint(tmp_path, model, monkeypatch, capfd):
    """SIGINT there printed "nothing was saved" although the final checkpoint was: the
    KeyboardInterrupt reached launch/train.py's catch-all for SIGINT outside the training
    loop. In this process (the signal is real, sent to this process inside the export's
    safetensors write): the export raises its own ExportError, which launch/train.py prints
    as one line and exits with its status (the TP=2 test above runs that path as a command)."""
    export = tmp_path / "hf"
    real = modeling_utils.safe_save_file

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_save_file", interrupted)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(ExportError) as info:
            train(_args(tmp_path, export), str(tmp_path / "run"))
    except KeyboardInterrupt:  # the old behaviour; would otherwise stop the whole pytest session
        pytest.fail("SIGINT during the export escaped as KeyboardInterrupt")
    assert signal.getsignal(signal.SIGINT) == handler  # given back
    assert isinstance(info.value, CheckpointError) and info.value.exit_status == 130
    assert (f"checkpoint.export_hf: writing {export} failed: interrupted by SIGINT; removed the partial "
            f"{partial_path(str(export))}; nothing was written to {export}; the checkpoint {tmp_path / 'ck'}"
            ) in str(info.value), str(info.value)
    err = capfd.readouterr().err
    assert "nothing was saved" not in err and "Traceback" not in err, err[-3000:]
    assert not export.exists() and not os.path.exists(partial_path(str(export)))


def test_a_full_disk_during_export_then_the_same_command_completes_it(tmp_path, model, monkeypatch, capsys):
    """In this process, the file-size limit set for the length of the export's write (capsys
    keeps what Python prints in memory, off pytest's capture file): the ExportError is the
    one line launch/train.py prints (the TP=2 test above runs that path as a command)."""
    export = tmp_path / "hf"
    limit = 16 << 10  # config.json fits; the ~150 kB model.safetensors does not
    real = hf_export.save_pretrained

    def small_files(*args, **kwargs):
        unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, unlimited[1]))
        try:
            return real(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)

    monkeypatch.setattr(hf_export, "save_pretrained", small_files)
    with pytest.raises(ExportError) as info:
        train(_args(tmp_path, export), str(tmp_path / "run"))
    error = str(info.value)
    assert "\n" not in error and info.value.exit_status == 1, error
    assert f"writing {export} failed: the file-size limit (ulimit -f) was reached" in error, error
    assert f"removed the partial {partial_path(str(export))}" in error, error
    assert "Traceback" not in capsys.readouterr().err
    assert not export.exists() and not os.path.exists(partial_path(str(export)))
    monkeypatch.undo()
    result = train(_args(tmp_path, export), str(tmp_path / "run2"))  # the same command, disk freed
    assert result.already_complete and _exported(export)


def test_export_target_is_checked_before_training(tmp_path, model):
    base = ["+model=hf", f"model.path={tmp_path / 'model'}"]
    left = tmp_path / "hf.partial"
    left.mkdir()  # as a SIGKILL during an export leaves it
    msg = precheck([*base, f"checkpoint.export_hf={tmp_path / 'hf'}"], CONFIG_DIR, 1)
    assert msg == (f"checkpoint.export_hf: {left} is left from an export that was killed (or one running now); "
                   f"remove it (rm -r {left}) and run the same command again"), msg
    (tmp_path / "afile").write_text("")
    msg = precheck([*base, f"checkpoint.export_hf={tmp_path / 'afile' / 'hf'}"], CONFIG_DIR, 1)
    assert msg == f"checkpoint.export_hf: {tmp_path / 'afile' / 'hf'} cannot be created: {tmp_path / 'afile'} is " \
                  "not a directory", msg
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o555)
    if not os.access(locked, os.W_OK):  # root writes anywhere: nothing to refuse there
        with pytest.raises(ValueError, match=rf"{locked / 'hf'} cannot be created: {locked} is not writable"):
            check_export_target(str(locked / "hf"))


def test_a_target_created_during_the_export_is_not_replaced(tmp_path, monkeypatch):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16))
    target = tmp_path / "hf"
    real = hf_export.save_pretrained

    def meanwhile(*args, **kwargs):
        real(*args, **kwargs)
        (target / "theirs").mkdir(parents=True)  # someone else's directory appears before the rename

    monkeypatch.setattr(hf_export, "save_pretrained", meanwhile)
    with pytest.raises(hf_export.ExportError, match=rf"writing {target} failed: created by someone else during the "
                                                    rf"export \({target}\); removed the partial {target}.partial"):
        hf_export.export_hf_directory(model, None, True, str(target), next_step="rerun")
    assert os.listdir(target) == ["theirs"] and not os.path.exists(partial_path(str(target)))
    monkeypatch.undo()
    (target / "theirs").rmdir()
    target.rmdir()
    hf_export.export_hf_directory(model, None, True, str(target))
    assert _exported(target) and not os.path.exists(partial_path(str(target)))
