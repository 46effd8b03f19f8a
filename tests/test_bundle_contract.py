"""The bundle contract: manifest round trip and refusals (paths, missing files, schema version)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hexforge.bundle.errors import BundleError
from hexforge.bundle.manifest import Manifest, confine, load_manifest, save_manifest


@pytest.fixture
def copy(bundle, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(bundle("llama"), dst)
    return dst


def _edit(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_manifest_round_trip(copy):
    m = load_manifest(copy)
    save_manifest(copy, m)
    again = load_manifest(copy)
    assert again == m
    assert Manifest.model_validate(json.loads(json.dumps(m.model_dump(mode="json")))) == m


@pytest.mark.parametrize("bad", ["../outside.onnx", "/etc/passwd", "cpu/../../x.onnx", "C:\\x.onnx"])
def test_path_escaping_the_bundle_is_refused(copy, bad):
    _edit(copy, lambda m: m["targets"]["cpu"]["graphs"][0].__setitem__("file", bad))
    with pytest.raises(BundleError) as e:
        load_manifest(copy)
    assert "\n" not in str(e.value)


def test_symlink_pointing_outside_is_refused(copy, tmp_path):
    outside = tmp_path / "secret.onnx"
    outside.write_bytes(b"x")
    os.symlink(outside, copy / "cpu" / "evil.onnx")
    _edit(copy, lambda m: m["targets"]["cpu"]["graphs"][0].__setitem__("file", "cpu/evil.onnx"))
    with pytest.raises(BundleError, match="outside the bundle"):
        load_manifest(copy)
    with pytest.raises(BundleError):
        confine(copy, "cpu/evil.onnx")


def test_missing_file_is_refused(copy):
    (copy / "cpu" / "head.onnx").unlink()
    with pytest.raises(BundleError, match=r"cpu/head.onnx.*missing"):
        load_manifest(copy)


def test_wrong_schema_version_is_refused(copy):
    _edit(copy, lambda m: m.__setitem__("schema_version", 99))
    with pytest.raises(BundleError, match="schema_version 99 is not supported"):
        load_manifest(copy)


def test_not_json_and_wrong_types_are_refused(copy):
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_manifest(copy)
    (copy / "manifest.json").write_text(json.dumps({"schema_version": 1, "family": 3}))
    with pytest.raises(BundleError, match="invalid manifest"):
        load_manifest(copy)


def test_external_data_escaping_the_bundle_is_refused(copy, tmp_path):
    """An ONNX file may name any path as external data: the loader confines it too."""
    import onnx

    import hexforge

    g = copy / "cpu" / "head.onnx"
    model = onnx.load(str(g), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../../../etc/passwd"
    onnx.save(model, str(g))
    # a crafted bundle records the crafted file's size and digest too: the loader's own check
    from hexforge.bundle.bundlefiles import record

    _edit(copy, lambda m: m.__setitem__("file_records",
                                        [r.model_dump() for r in record(copy)]))
    with pytest.raises(BundleError, match="outside the bundle"):
        hexforge.load(copy)


def test_in_place_cache_binds_are_checked_on_load(copy):
    """A cpu decode graph's alias:<input> output must name a state input of that graph, and its
    kv_seqlens / kv_total inputs a group without a window (row p holds position p)."""
    m = json.loads((copy / "manifest.json").read_text())
    dec = next(g for g in m["targets"]["cpu"]["graphs"] if g["role"] == "decode")
    alias = next(o for o in dec["outputs"] if o["bind"].startswith("alias:"))
    alias["bind"] = "alias:hidden"
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="names no state input"):
        load_manifest(copy)
    alias["bind"] = "alias:" + alias["name"].removeprefix("present.")
    m["mask_groups"][0]["window"] = 8
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="no window"):
        load_manifest(copy)
