"""YAML files users hand us (issue 40 point 3): ``debug.config``, a ``model.plan`` file and
``overlap.config`` all go through ``tp_fuse.safe_yaml``: bounded size, no aliases (a 1 kB
"billion laughs" file was a ``MemoryError`` after minutes), one-line errors that never
print an aliased value."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tp_fuse.debug.config import load_debug_config
from tp_fuse.launch.config_parse import check_plan
from tp_fuse.overlap.config import OverlapConfig
from tp_fuse.safe_yaml import MAX_YAML_BYTES, load_yaml


def billion_laughs(levels: int = 9) -> str:
    """The classic: each level a list of nine aliases of the level below (9**levels strings)."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


# Each site in a child process under a 3 GiB address-space limit, so that code that expands
# the aliases fails there (and is reported with its time) instead of taking this machine's memory.
_SITES = textwrap.dedent("""
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    from tp_fuse.debug.config import load_debug_config
    from tp_fuse.launch.config_parse import check_plan
    from tp_fuse.overlap.config import OverlapConfig
    path = sys.argv[1]
    for name, load in (("debug", load_debug_config), ("plan", check_plan), ("overlap", OverlapConfig.from_yaml)):
        t = time.perf_counter()
        try:
            load(path)
            outcome = "accepted"
        except BaseException as exc:  # MemoryError / RecursionError on unbounded code
            outcome = type(exc).__name__ + ": " + str(exc)
        print(f"{name}\\t{time.perf_counter() - t:.3f}\\t{outcome[:2000]!r}", flush=True)
""")


def test_billion_laughs_is_refused_in_under_5_s_at_every_site(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(billion_laughs())
    assert path.stat().st_size < 1024
    proc = subprocess.run([sys.executable, "-c", _SITES, str(path)], capture_output=True, text=True, timeout=120)
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    assert [r[0] for r in rows] == ["debug", "plan", "overlap"], (proc.stdout, proc.stderr[-2000:])
    for name, seconds, outcome in rows:
        assert float(seconds) < 5.0, (name, seconds, outcome[:300])
        assert outcome.startswith("'ValueError: "), (name, outcome[:300])
        assert str(path) in outcome and "line 2, column 10: an alias (*l0)" in outcome, (name, outcome)
        assert "lol" not in outcome and "\\n" not in outcome, (name, outcome)  # never the value, one line


def test_an_alias_is_refused_even_where_it_would_be_harmless(tmp_path):
    # A plan file whose alias expands to one valid style: accepted before, refused now (the
    # loader cannot tell a harmless alias from a bomb without expanding it).
    plan = tmp_path / "plan.yaml"
    plan.write_text("model.layers.*.q_proj: &col column\nmodel.layers.*.k_proj: *col\n")
    with pytest.raises(ValueError, match=r"model\.plan: plan file .*plan\.yaml: line 2, column 24: an alias \(\*col\)"):
        check_plan(str(plan))
    merge = tmp_path / "debug.yaml"
    merge.write_text("base: &b {enabled: true}\nsec:\n  <<: *b\n  layers: {layer_types: [linear]}\n")
    with pytest.raises(ValueError, match=r"debug config .*debug\.yaml: line 3, column 7: an alias \(\*b\)"):
        load_debug_config(str(merge))


def test_a_yaml_file_over_the_size_cap_is_refused_naming_the_file_and_limit(tmp_path):
    # overlap.config was read whole with open().read(): a 5 MiB file of comments parsed as {}.
    big = tmp_path / "tp_comm_overlap_cfg.yaml"
    big.write_text("#" * (MAX_YAML_BYTES + 1) + "\n")
    with pytest.raises(ValueError, match=rf"{big} is larger than {MAX_YAML_BYTES} bytes"):
        OverlapConfig.from_yaml(str(big))
    with pytest.raises(ValueError, match=rf"more than the {MAX_YAML_BYTES} a config file may have"):
        load_yaml("#" * (MAX_YAML_BYTES + 1), "text")


def test_special_files_are_named_not_read(tmp_path):
    fifo = tmp_path / "overlap.yaml"
    os.mkfifo(fifo)
    link = tmp_path / "debug.yaml"
    os.symlink("/dev/zero", link)
    with pytest.raises(ValueError, match=rf"{fifo} is a FIFO, not a regular file"):
        OverlapConfig.from_yaml(str(fifo))  # was: open() waited for a writer forever
    with pytest.raises(ValueError, match=rf"{link} is a character device, not a regular file"):
        load_debug_config(str(link))  # was: "no such file"


@pytest.mark.parametrize("text, needle", [
    ("[" * 3000 + "]" * 3000, "nested too deeply to be a config file"),
    ("a: " + "9" * 5000 + "\n", "Exceeds the limit (4300 digits)"),
    ("a: [1, 2\nb: 3\n", "not valid YAML: line 2, column 2: while parsing a flow sequence"),
    ("a: \x07\n", "not valid YAML: "),
])
def test_malformed_yaml_is_one_line(text, needle):
    with pytest.raises(ValueError) as e:
        load_yaml(text, "where")
    msg = str(e.value)
    assert msg.startswith("where: ") and needle in msg and "\n" not in msg, msg
