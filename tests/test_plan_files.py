"""Plan files: every mistake in one pass, with the file, the line and the camelCase path; no protobuf internals;
`--json` prints JSON on failure too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paraminit_client import cli, load_plan, param, plan_from_dict
from paraminit_client.plans import PlanFileError

THREE = """{"params": [
  {"name": "w", "shap": [4],
   "dtype": "bfloat61",
   "init": {"normal": {"stdev": 1}}}
]}
"""


def problems(tmp_path: Path, text: str, name: str = "p.json") -> PlanFileError:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(PlanFileError) as caught:
        load_plan(path)
    assert caught.value.file == str(path)
    return caught.value


def test_three_mistakes_are_three_problems_with_their_lines(tmp_path: Path) -> None:
    err = problems(tmp_path, THREE)
    got = [(q.where, q.line, q.message.split(";")[0]) for q in err.problems]
    assert got == [
        ("params[0]", "2", "unknown field 'shap' (did you mean 'shape'?)"),
        ("params[0].dtype", "3", "unknown dtype 'bfloat61' (did you mean 'bfloat16'?)"),
        ("params[0].init.normal", "4", "unknown field 'stdev' (did you mean 'std'?)"),
    ]
    text = str(err)
    assert f"{tmp_path / 'p.json'}:3: params[0].dtype: unknown dtype" in text and "3 problems" in text


def test_unknown_initializers_and_two_kinds_are_all_named(tmp_path: Path) -> None:
    plan = {
        "params": [
            {"name": "a", "shape": [2], "init": {"kaimingUnifrom": {}, "zero": {}}},
            {"name": "b", "shape": [2], "init": {"kaimingUniformForShape": {}, "zeros": {}}},
        ]
    }
    err = problems(tmp_path, json.dumps(plan, indent=1))
    text = str(err)
    assert "unknown initializer 'kaimingUnifrom' (did you mean 'kaimingUniform'?)" in text
    assert "unknown initializer 'zero' (did you mean 'zeros'?)" in text
    assert "params[1].init: more than one initializer: 'kaimingUniformForShape', 'zeros'" in text
    for internal in ("oneof", "Message type", "paraminit.v1", "Failed to parse", "which is"):
        assert internal not in text, internal


def test_type_errors_are_named_without_protobuf_words(tmp_path: Path) -> None:
    plan = {
        "params": [
            {"name": 3, "shape": [4, "x", 2.5], "init": {"normal": {"std": "big", "seed": -1}}},
            {"name": "b", "shape": 4, "init": {"zeros": []}},
            {"name": "c", "shape": [2], "dtype": "float8", "init": {"uniform": {"lo": "-Infinity"}}},
        ]
    }
    err = problems(tmp_path, json.dumps(plan))
    by_path = {q.where: q.message for q in err.problems}
    assert by_path["params[0].name"].startswith("expected a string, got a number")
    assert by_path["params[0].shape[1]"].startswith("expected a whole number, got a string")
    assert by_path["params[0].shape[2]"].startswith("expected a whole number, got a number (2.5)")
    assert by_path["params[0].init.normal.std"].startswith("expected a number")
    assert by_path["params[0].init.normal.seed"] == "must not be negative, got -1"
    assert by_path["params[1].shape"].startswith("expected a list, got a number")
    assert by_path["params[1].init.zeros"].startswith("expected an object, got a list")
    # 'float8' is no 'float': a suggestion keeps the bit width written
    assert by_path["params[2].dtype"].startswith("unknown dtype 'float8'; valid:")
    assert "params[2].init" not in by_path  # "-Infinity" is a valid double
    assert "repeated field" not in str(err) and "which is" not in str(err)


def test_a_trailing_comma_is_reported_where_it_is(tmp_path: Path) -> None:
    text = '{"params": [\n  {"name": "w", "shape": [4], "init": {"zeros": {}}},\n]}\n'
    err = problems(tmp_path, text)
    (q,) = err.problems
    assert q.line == f"2:{text.splitlines()[1].rindex(',') + 1}" and "trailing comma" in q.message


def test_yaml_errors_name_the_file_and_line(tmp_path: Path) -> None:
    err = problems(tmp_path, "params:\n  - name: w\n    shape: [4\n", "p.yaml")
    assert "<unicode string>" not in str(err) and str(tmp_path / "p.yaml") in str(err)
    assert err.problems[0].line is not None
    err = problems(tmp_path, "params:\n  - name: w\n    shape: [4]\n    init: {normall: {}}\n", "p.yaml")
    assert [(q.where, q.line) for q in err.problems] == [("params[0].init", "4")]


def test_yaml_aliases_are_refused_before_they_expand(tmp_path: Path) -> None:
    """Nested aliases make a few hundred bytes expand to gigabytes ("billion laughs"): a plan file may hold none."""
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10^9 leaves if expanded
    err = problems(tmp_path, "\n".join([*levels, "params: *a8", ""]), "bomb.yaml")
    assert [(q.message, q.line) for q in err.problems] == [("YAML syntax: aliases (*name) are not allowed in plan files", "2:10")]


def test_duplicate_keys_are_a_problem(tmp_path: Path) -> None:
    err = problems(tmp_path, '{"params": [{"name": "w", "shape": [4], "shape": [5], "init": {"zeros": {}}}]}')
    assert "duplicate key 'shape'" in str(err)


def test_builders_report_every_problem_too() -> None:
    with pytest.raises(ValueError, match=r"unknown field 'stdd'.*unknown field 'meen'"):
        param("w", [2], {"normal": {"stdd": 1, "meen": 0}})
    with pytest.raises(PlanFileError, match="top level must be an object"):
        plan_from_dict([])  # type: ignore[arg-type]


def test_validate_json_prints_json_on_every_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    path.write_text(THREE)
    code = cli.main(["validate", str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_INVALID
    doc = json.loads(out)
    assert doc["ok"] is False and doc["exit_code"] == 2 and len(doc["violations"]) == 3
    assert [v["line"] for v in doc["violations"]] == [2, 3, 4]
    assert "stdev" in err  # the words are on stderr as well
    code = cli.main(["validate", str(tmp_path / "missing.json"), "--json"])
    out, _ = capsys.readouterr()
    assert code == cli.EXIT_ERROR and "missing.json" in json.loads(out)["error"]


def test_server_violation_paths_are_camel_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"params": [{"name": "k", "shape": [3], "init": {"kaimingUniformForShape": {}}}]}))
    code = cli.main(["validate", str(path), "--json"])
    out, _ = capsys.readouterr()
    doc = json.loads(out)
    assert code == cli.EXIT_INVALID
    assert [v["field"] for v in doc["violations"]] == ["params[0].init.kaimingUniformForShape"]


def test_one_parameter_is_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"params": [{"name": "z", "shape": [3], "init": {"zeros": {}}}]}))
    assert cli.main(["validate", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert ": 1 parameter," in out and "1 parameters" not in out


def test_plan_violations_name_their_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan's violations (found by validation, not by the file reader) read like the file's own mistakes:
    FILE:LINE, the line where the file writes the field, whichever spelling it uses (snake_case here), in text and
    in --json, for validate and materialize alike."""
    path = tmp_path / "p.yaml"
    path.write_text(
        "params:\n"
        "  - name: a\n"
        "    shape: [4]\n"
        "    init:\n"
        "      normal: {std: -1}\n"
        "  - name: b\n"
        "    shape: [2]\n"
        "    init:\n"
        "      kaiming_uniform_for_shape: {}\n"
    )
    code = cli.main(["validate", str(path)])
    _, err = capsys.readouterr()
    assert code == cli.EXIT_INVALID
    assert f"  {path}:5: params[0].init.normal ('a'): " in err and f"  {path}:9: params[1].init.kaimingUniformForShape ('b'): " in err
    code = cli.main(["validate", str(path), "--json"])
    out, _ = capsys.readouterr()
    assert [(v["file"], v["line"]) for v in json.loads(out)["violations"]] == [(str(path), 5), (str(path), 9)]
    code = cli.main(["materialize", str(path), "-o", str(tmp_path / "x.safetensors")])
    _, err = capsys.readouterr()
    assert code == cli.EXIT_INVALID and f"  {path}:9: params[1].init.kaimingUniformForShape" in err
    from paraminit_client.plans import field_lines

    assert field_lines(path, ["params[1].init", "params[7].name", "params", "nothing"]) == [8, 1, 1, None]
    assert field_lines("-", ["params[0]"]) == [None]
