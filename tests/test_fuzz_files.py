"""Property-based fuzzing of every file duet reads from a user (issue 34's file surfaces).

Deployment configs, autoscaling policies, SLO profiles, placement plans, API-key files and
trace files (Azure CSV, Mooncake JSONL) get arbitrary bytes, arbitrary YAML and well-formed
documents with hostile values. For every input the loader either returns its model or raises
its own error type (what the CLI prints as a message), never anything else: a ``TypeError``,
``UnicodeDecodeError`` or ``csv.Error`` reaching the user is a traceback, which this test
counts as a failure. A seeded pass at a size that keeps the suite fast (150 inputs per
property); ``DUET_FUZZ_EXAMPLES=5000`` runs a longer, unseeded one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from duet.cluster.autoscaler.policy import PolicyError, load_policy, load_slo
from duet.cluster.placement.plan import Plan, PlanError
from duet.cluster.placement.trace import TraceError, load_trace
from duet.config import AuthConfig, ConfigError, load_config, parse_config
from duet.router.auth import Gatekeeper

_EXAMPLES = int(os.environ.get("DUET_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=_EXAMPLES or 150, derandomize=not _EXAMPLES, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], database=None,
)

# Values a YAML document can hold, hostile ones included: huge and negative numbers, NaN,
# empty and odd strings, nesting where a scalar is expected.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.sampled_from(["", "-1", "0", "1e309", "nan", "auto", "../../etc/passwd", "\x00"]),
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12,
)


def _mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` (a valid document) with one field, at any depth, replaced by a hostile value."""
    paths: list[tuple[str, ...]] = []

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                paths.append(prefix + (key,))
                walk(value, prefix + (key,))

    walk(base, ())

    def replace(path: tuple[str, ...], value: Any) -> dict[str, Any]:
        document = json.loads(json.dumps(base, default=str))
        node = document
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return document

    return st.builds(replace, st.sampled_from(paths), documents)


def _in_file(content: bytes, suffix: str) -> Path:
    handle = tempfile.NamedTemporaryFile(suffix=suffix, delete=False)
    handle.write(content)
    handle.close()
    return Path(handle.name)


def _loads_or_refuses(load: Callable[[Path], Any], content: bytes, suffix: str, error: type[Exception]) -> None:
    path = _in_file(content, suffix)
    try:
        load(path)
    except error as refused:
        assert str(refused), "an error with no message"
    finally:
        path.unlink()


def _yaml_bytes(document: Any) -> bytes:
    return yaml.safe_dump(document, allow_unicode=True).encode()


raw_bytes = st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode))
VALID_CONFIG = load_config().model_dump(mode="json")


# Each @example is a defect this fuzzing found (a traceback instead of a message), kept as a
# regression case: non-UTF-8 files, infinite and overflowing numbers, degenerate parameters.


@FUZZ
@given(content=st.one_of(raw_bytes, documents.map(_yaml_bytes)))
@example(content=b"\x80")
def test_config_files(content: bytes):
    _loads_or_refuses(load_config, content, ".yaml", ConfigError)


@FUZZ
@given(document=_mutated(VALID_CONFIG))
def test_configs_with_one_hostile_field(document: dict[str, Any]):
    try:
        parse_config(document)
    except ConfigError as refused:
        assert "is invalid" in str(refused) or ":" in str(refused)


@FUZZ
@given(content=st.one_of(raw_bytes, documents.map(_yaml_bytes)))
@example(content=b"\xff\xfe")
def test_autoscaling_policies_and_slo_profiles(content: bytes):
    _loads_or_refuses(lambda path: load_policy(str(path)), content, ".yaml", PolicyError)
    _loads_or_refuses(lambda path: load_slo(str(path)), content, ".yaml", PolicyError)


@FUZZ
@given(content=st.one_of(raw_bytes, documents.map(_yaml_bytes)))
@example(content=b"\x80")
def test_plan_files(content: bytes):
    _loads_or_refuses(Plan.load, content, ".yaml", PlanError)


@FUZZ
@given(content=st.one_of(raw_bytes, documents.map(_yaml_bytes), st.builds(lambda keys: _yaml_bytes({"keys": keys}), documents)))
@example(content=b"\x80")
def test_api_key_files(content: bytes):
    _loads_or_refuses(lambda path: Gatekeeper.from_config(AuthConfig(api_keys_file=str(path)), environ={}), content, ".yaml", ConfigError)


mooncake_rows = st.dictionaries(
    st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "other"]), scalars, max_size=5
).map(lambda row: json.dumps(row).encode())
azure_rows = st.lists(st.one_of(scalars.map(str), st.just("2023-11-16 18:15:46.6805900")), min_size=0, max_size=4).map(
    lambda cells: ",".join(cells).encode()
)


@FUZZ
@given(content=st.one_of(raw_bytes, st.lists(mooncake_rows, max_size=6).map(b"\n".join)))
@example(content=b"\x80")
@example(content=b'{"timestamp": 0, "input_length": Infinity, "output_length": 1}')
@example(content=b'{"timestamp": 0, "input_length": 1e20, "output_length": 1}')
@example(content=b'{"timestamp": NaN, "input_length": 1, "output_length": 1}')
def test_mooncake_trace_files(content: bytes):
    _loads_or_refuses(lambda path: load_trace(str(path)), content, ".jsonl", TraceError)


@FUZZ
@given(content=st.one_of(raw_bytes, st.lists(azure_rows, max_size=6).map(lambda rows: b"TIMESTAMP,ContextTokens,GeneratedTokens\n" + b"\n".join(rows))))
@example(content=b"\x80")
@example(content=b"TIMESTAMP,ContextTokens,GeneratedTokens\n\x00")
def test_azure_trace_files(content: bytes):
    _loads_or_refuses(lambda path: load_trace(str(path)), content, ".csv", TraceError)


@FUZZ
@given(spec=st.one_of(st.text(max_size=60).map(lambda body: "synthetic:" + body), st.builds(
    lambda n, rate, cv, lengths: f"synthetic:n={n},rate={rate},cv={cv},lengths={lengths}",
    st.integers(-5, 3000), st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["sharegpt", "fixed:8:8", "fixed:-1:2", "fixed:a:b", "nope"]),
)))
@example(spec="synthetic:n=1,rate=1.0,cv=1.3407807929942597e+154")
@example(spec="synthetic:n=1,rate=1.0,cv=2.790307631734632e-232")
@example(spec="synthetic:n=1,rate=nan")
@example(spec="synthetic:n=1,lengths=fixed:-1:2")
def test_synthetic_trace_specs(spec: str):
    try:
        load_trace(spec)
    except TraceError as refused:
        assert str(refused)


# ---- LoRA adapters: directories, names and paths (issue 56) -------------------------------

adapter_names = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["../x", "..", ".", "a/b", "a\x00b", "-x", "x" * 65, "duet-tiny-llama", "lora one", "é", "~root", "lora-1"]),
)
adapter_paths = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["VALID", "VALID/", "VALID/adapter_config.json", "/dev/null", "/proc/self", "/", "~", "\x00", "a" * 5000, "/etc"]),
)


@pytest.fixture(scope="module")
def valid_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from duet.worker_runtime.tiny_lora import make_tiny_lora

    return make_tiny_lora(tmp_path_factory.mktemp("adapter") / "lora")


@FUZZ
@given(
    config=st.one_of(
        raw_bytes,
        documents.map(lambda document: json.dumps(document).encode()),
        st.builds(lambda rank, peft: json.dumps({"r": rank, "peft_type": peft}).encode(), scalars, st.one_of(scalars, st.just("LORA"))),
    ),
    weights=st.booleans(),
)
@example(config=b"[" * 100_000, weights=True)
@example(config=b'{"r": true}', weights=True)
@example(config=b'{"r": 8}', weights=False)
@example(config=b"\xff\xfe", weights=True)
def test_adapter_directories(config: bytes, weights: bool):
    """Whatever an adapter directory holds, its check names the adapter's rank or refuses it
    with a plain ValueError that says what is wrong (never a decode or recursion error)."""
    from duet.config import adapter_rank

    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "adapter_config.json").write_bytes(config)
        if weights:
            (Path(directory) / "adapter_model.safetensors").write_bytes(b"\0")
        try:
            rank = adapter_rank(directory)
        except ValueError as refused:
            assert type(refused) is ValueError and str(refused)
        else:
            assert type(rank) is int and rank >= 1 and weights


@FUZZ
@given(name=adapter_names, path=adapter_paths)
@example(name="lora-1", path="VALID")
def test_adapter_names_and_paths(valid_adapter: Path, name: str, path: str):
    """A runtime load's name and path (the Admin API's and ``/v1/load_lora_adapter``'s) are
    served only when the name is a plain model name and the path an adapter directory;
    anything else is refused as invalid, with a message."""
    import re

    from duet.config import ADAPTER_NAME_PATTERN
    from duet.router.lora_adapters import AdapterError, AdapterRegistry

    path = path.replace("VALID", str(valid_adapter))
    document = json.loads(json.dumps(VALID_CONFIG))
    document["model"]["lora"] = {"adapters": []}
    registry = AdapterRegistry(parse_config(document).model)
    try:
        adapter = registry.new_adapter(name, path)
    except AdapterError as refused:
        assert refused.kind == "invalid" and str(refused)
    else:
        assert re.match(ADAPTER_NAME_PATTERN, name) and name != document["model"]["name"]
        assert Path(adapter.path).resolve() == valid_adapter.resolve()


@FUZZ
@given(name=adapter_names, path=adapter_paths, limits=st.dictionaries(st.sampled_from(["max_loras", "max_lora_rank", "max_cpu_loras"]), scalars, max_size=3))
def test_configs_with_hostile_adapters(valid_adapter: Path, name: str, path: str, limits: dict[str, Any]):
    document = json.loads(json.dumps(VALID_CONFIG))
    document["model"]["lora"] = {"adapters": [{"name": name, "path": path.replace("VALID", str(valid_adapter))}], **limits}
    try:
        parse_config(document)
    except ConfigError as refused:
        assert "lora" in str(refused)
