"""Security invariants: no code runs from loaded files, no path escapes the adapter store, no port is opened.

The source scans read our own code with `ast` (not grep, so comments and strings do not count),
and each rule is first run on a snippet that breaks it, so a scan that finds nothing has shown
that it can find something.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from conftest import REPO
from safetensors.numpy import save_file

from pipeline.store import weights as adapter_store
from pipeline.store.weights import PICKLE_SUFFIXES, AdapterStore, content_hash
from pipeline.config.schema import ModelConfig
from pipeline.errors import AdapterCorruptError, AdapterError, AdapterNotFoundError, StoreError

Rule = Callable[[ast.AST], "list[str]"]


def sources(*parts: str) -> list[Path]:
    """The .py files under the given repo-relative folders or files."""
    found: list[Path] = []
    for part in parts:
        p = REPO / part
        found.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    assert found, f"no python files under {parts}"
    return found


def scan(rule: Rule, *parts: str) -> list[str]:
    """`file:line: what` for every place in the given sources that breaks `rule`."""
    bad: list[str] = []
    for path in sources(*parts):
        tree = ast.parse(path.read_text(), filename=str(path))
        bad += [f"{path.relative_to(REPO)}:{where}" for where in rule(tree)]
    return bad


def calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def attr_call(call: ast.Call, attr: str, on: str | None = None) -> bool:
    """`call` is `<x>.attr(...)`, with x the bare name `on` when given."""
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == attr
            and (on is None or isinstance(f.value, ast.Name) and f.value.id == on))


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def imported_modules(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) for each import statement."""
    out: list[tuple[int, str, list[str]]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(n.lineno, a.name, []) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module:
            out.append((n.lineno, n.module, [a.name for a in n.names]))
    return out


def assert_rule_catches(rule: Rule, bad: str, good: str) -> None:
    """The rule flags every statement of `bad` (one per line) and nothing in `good`."""
    for line in bad.strip().splitlines():
        assert rule(ast.parse(line)), f"the rule misses {line!r}"
    assert rule(ast.parse(good)) == [], f"the rule flags {good!r}"


# --- no unpickling -------------------------------------------------------------------------


def torch_load_without_weights_only(tree: ast.AST) -> list[str]:
    """torch.load unpickles, and can run code, unless weights_only=True (literally)."""
    bad = [f"{c.lineno}: torch.load without weights_only=True" for c in calls(tree)
           if attr_call(c, "load", on="torch") and not is_true(keyword(c, "weights_only"))]
    bad += [f"{line}: from torch import load (calls cannot be checked)"
            for line, module, names in imported_modules(tree) if module == "torch" and "load" in names]
    return bad


PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve"}


def unpickling(tree: ast.AST) -> list[str]:
    bad = [f"{line}: imports {module}" for line, module, _ in imported_modules(tree)
           if module.split(".")[0] in PICKLE_MODULES]
    bad += [f"{c.lineno}: {c.func.value.id}.{c.func.attr}" for c in calls(tree)  # type: ignore[attr-defined]
            if isinstance(c.func, ast.Attribute) and c.func.attr in ("load", "loads", "Unpickler")
            and isinstance(c.func.value, ast.Name) and c.func.value.id in PICKLE_MODULES]
    bad += [f"{c.lineno}: np.load with allow_pickle" for c in calls(tree)
            if attr_call(c, "load") and not pickle_off(keyword(c, "allow_pickle"))]
    return bad


def pickle_off(allow_pickle: ast.expr | None) -> bool:
    """numpy's allow_pickle is absent (default False) or literally False."""
    return allow_pickle is None or isinstance(allow_pickle, ast.Constant) and allow_pickle.value is False


def test_torch_load_always_passes_weights_only_true() -> None:
    assert_rule_catches(torch_load_without_weights_only,
                        bad="torch.load(f)\ntorch.load(f, weights_only=False)\ntorch.load(f, weights_only=flag)\n"
                            "from torch import load",
                        good="torch.load(f, map_location='cpu', weights_only=True)\nmodel.load(f)")
    assert scan(torch_load_without_weights_only, "pipeline", "benchmarks", "run.py") == []


def test_pipeline_never_unpickles() -> None:
    assert_rule_catches(unpickling,
                        bad="import pickle\nfrom cloudpickle import loads\npickle.loads(b)\n"
                            "np.load(f, allow_pickle=True)\nimport dill.settings",
                        good="import json\njson.loads(s)\nnp.load(f)\nnp.load(f, allow_pickle=False)")
    assert scan(unpickling, "pipeline") == []


# --- no remote code -----------------------------------------------------------------------

# peft's from_pretrained reads adapter_config.json and the adapter weights; it runs no code
# from the directory and takes no trust_remote_code (it would pass it on to the hub download)
NO_REMOTE_CODE_LOADERS = re.compile(r"^Peft")


def from_pretrained_trusting_implicitly(tree: ast.AST) -> list[str]:
    bad = []
    for c in calls(tree):
        if not attr_call(c, "from_pretrained"):
            continue
        owner = c.func.value  # type: ignore[attr-defined]
        if isinstance(owner, ast.Name) and NO_REMOTE_CODE_LOADERS.match(owner.id):
            continue
        trust = keyword(c, "trust_remote_code")
        if trust is None:
            bad.append(f"{c.lineno}: from_pretrained without an explicit trust_remote_code=")
        elif is_true(trust):
            bad.append(f"{c.lineno}: from_pretrained with trust_remote_code=True")
    return bad


def test_from_pretrained_always_decides_trust_remote_code_explicitly() -> None:
    assert_rule_catches(from_pretrained_trusting_implicitly,
                        bad="AutoTokenizer.from_pretrained(p)\nAutoModelForCausalLM.from_pretrained(p, "
                            "trust_remote_code=True)\nself.cls.from_pretrained(p)",
                        good="AutoTokenizer.from_pretrained(p, trust_remote_code=cfg.trust_remote_code)\n"
                             "PeftModel.from_pretrained(model, path)")
    assert scan(from_pretrained_trusting_implicitly, "pipeline") == []
    assert ModelConfig().trust_remote_code is False


# --- no listening socket ------------------------------------------------------------------

SERVER_CALLS = {"start_server", "start_unix_server", "create_server", "create_unix_server", "listen",
                "serve_forever", "Listener", "Manager", "BaseManager", "SyncManager"}
SERVER_NAMES = {"HTTPServer", "ThreadingHTTPServer", "TCPServer", "UDPServer", "ThreadingTCPServer",
                "SimpleXMLRPCServer"}
SERVER_MODULES = {"socketserver", "http.server", "xmlrpc.server", "multiprocessing.managers", "aiohttp.web",
                  "uvicorn", "fastapi", "flask"}
# aiohttp's client (the vllm_server engine) connects out; its server side lives in aiohttp.web*


def aiohttp_server(module: str, names: list[str]) -> bool:
    return module.startswith("aiohttp.web") or (module == "aiohttp" and any(n.startswith("web") for n in names))


def listening(tree: ast.AST) -> list[str]:
    bad = []
    for c in calls(tree):
        f = c.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if attr_call(c, "socket", on="socket") or name in SERVER_CALLS | SERVER_NAMES:
            bad.append(f"{c.lineno}: {name}(...)")
        # a socket's bind takes the address positionally; structlog's bind takes keywords only
        elif name == "bind" and c.args:
            bad.append(f"{c.lineno}: .bind({ast.unparse(c.args[0])})")
    for line, module, names in imported_modules(tree):
        if module in SERVER_MODULES or module.split(".")[0] in SERVER_MODULES or aiohttp_server(module, names):
            bad.append(f"{line}: imports {module}")
        bad += [f"{line}: imports {n}" for n in names if n in SERVER_NAMES or n in ("Listener", "socket")]
    bad += [f"{n.lineno}: {n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in SERVER_NAMES]
    bad += [f"{n.lineno}: aiohttp.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and n.attr.startswith("web") and isinstance(n.value, ast.Name) and n.value.id == "aiohttp"]
    return bad


def test_pipeline_opens_no_listening_socket() -> None:
    assert_rule_catches(listening,
                        bad="socket.socket(socket.AF_INET)\ns.bind(('0.0.0.0', 8000))\n"
                            "asyncio.start_server(handle, port=1)\nloop.create_server(f)\n"
                            "http.server.HTTPServer(addr, h)\nfrom http.server import HTTPServer\n"
                            "mp.Manager()\nfrom multiprocessing.connection import Listener\nsock.listen()\n"
                            "from aiohttp import web\nimport aiohttp.web\naiohttp.web.run_app(app)\n"
                            "from aiohttp.web_runner import AppRunner",
                        good="log = log.bind(engine='e0')\nsocket.gethostname()\nparent, child = ctx.Pipe()\n"
                             "import aiohttp\naiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))")
    assert scan(listening, "pipeline") == []


# --- the adapter store --------------------------------------------------------------------


def write_adapter(d: Path, value: float = 0.0) -> None:
    save_file({"lora_A": np.full((2, 2), value, dtype=np.float32)}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"r": 2, "peft_type": "LORA"}))


@pytest.mark.parametrize("suffix", PICKLE_SUFFIXES + (".BIN",))
def test_the_adapter_store_refuses_pickle_files_at_publish_and_at_load(tmp_path: Path, suffix: str) -> None:
    store = AdapterStore(tmp_path)
    with pytest.raises(StoreError, match=rf"refusing to publish pickle files \['adapter_model{re.escape(suffix)}'\]"):
        store.publish(1, lambda d: (write_adapter(d), (d / f"adapter_model{suffix}").write_bytes(b"\x80\x04.")))
    ref = store.publish(1, write_adapter)
    (Path(ref.path) / f"adapter_model{suffix}").write_bytes(b"\x80\x04.")  # dropped in after publishing
    with pytest.raises(AdapterCorruptError, match=rf"adapter_model{re.escape(suffix)} is not listed"):
        store.load(1)


@pytest.mark.parametrize("bad", [-1, "1", "../v000001", 1.0, True, None, [1]])
def test_versions_must_be_non_negative_ints(tmp_path: Path, bad: object) -> None:
    store = AdapterStore(tmp_path)
    store.publish(1, write_adapter)
    for lookup in (store.ref, store.load, store.pin, store.discard_after):
        with pytest.raises(ValueError, match="int >= 0"):
            lookup(bad)  # type: ignore[arg-type]


def test_a_symlinked_version_directory_is_never_followed(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "adapters", tmp_path / "elsewhere"
    store = AdapterStore(root)
    v1 = store.publish(1, write_adapter)
    planted = AdapterStore(elsewhere).publish(1, lambda d: write_adapter(d, 7.0))  # a valid adapter outside
    (root / f"v000003-{planted.sha256[:8]}").symlink_to(Path(planted.path))
    alias = root / f"v000002-{v1.sha256[:8]}"
    alias.symlink_to(Path(v1.path))  # a link inside the root is refused too

    assert store.versions() == [1] and store.latest() == v1
    for version in (2, 3):
        with pytest.raises(AdapterNotFoundError):
            store.load(version)
        with pytest.raises(AdapterNotFoundError):
            store.ref(version)
    for link in (root / f"v000003-{planted.sha256[:8]}", alias):
        with pytest.raises(AdapterCorruptError, match=rf"{re.escape(str(link))} is a symbolic link"):
            store.verify_dir(link)
    with pytest.raises(AdapterError, match="not a version directory of the adapter store"):
        store.verify_dir(planted.path)


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/tmp/outside.safetensors", "..",
                                    "sub/adapter.safetensors", "..\\outside.safetensors", "x\0.safetensors"])
def test_a_manifest_cannot_name_a_file_outside_its_directory(tmp_path: Path, escape: str) -> None:
    """The manifest is otherwise valid (content hash and name agree): only the name check stops it."""
    root = tmp_path / "adapters"
    store = AdapterStore(root)
    ref = store.publish(1, write_adapter)
    d = Path(ref.path)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"secret")
    manifest = json.loads((d / "manifest.json").read_text())
    files = {"adapter_config.json": manifest["files"]["adapter_config.json"],
             escape: hashlib.sha256(b"secret").hexdigest()}
    digest = content_hash(files)
    manifest.update(files=files, content_sha256=digest)
    forged = root / f"v000002-{digest[:8]}"
    forged.mkdir()
    (forged / "adapter_config.json").write_bytes((d / "adapter_config.json").read_bytes())
    (forged / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    for check in (lambda: store.load(2), lambda: store.ref(2), lambda: store.verify_dir(forged)):
        with pytest.raises(AdapterCorruptError, match=rf"invalid file name {re.escape(repr(escape))}"):
            check()


def test_a_listed_file_that_is_a_symlink_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "adapters")
    ref = store.publish(1, write_adapter)
    target = Path(ref.path) / "adapter_model.safetensors"
    outside = tmp_path / "same-bytes.safetensors"
    outside.write_bytes(target.read_bytes())  # the hash would match: only the link check can refuse it
    target.unlink()
    target.symlink_to(outside)
    with pytest.raises(AdapterCorruptError, match="adapter_model.safetensors is a symbolic link"):
        store.load(1)
    assert os.path.samefile(target, outside)


def test_adapter_files_are_opened_without_following_symlinks(tmp_path: Path) -> None:
    """A file swapped for a link after the store checked it still cannot be read through the link."""
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError) as info:
        adapter_store._sha256_file(tmp_path / "link")
    assert info.value.errno == errno.ELOOP
    assert adapter_store._sha256_file(tmp_path / "real") == hashlib.sha256(b"x").hexdigest()
