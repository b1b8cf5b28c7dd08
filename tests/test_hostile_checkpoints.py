"""Hostile checkpoints (issue 20): shard paths that leave the folder, NaN and Inf weights, malformed configs,
tensors of the wrong dtype, and a drafter stored in another dtype than its target."""
import hashlib
import json
import math
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import tiny_drafter, tiny_target
from dflash_jax import cli, generate, load_drafter, load_target
from dflash_jax.config import CheckpointError
from dflash_jax.io import checkpoints
from dflash_jax.io.safetensors import INDEX_FILE, SINGLE_FILE, _open

EMBED = "model.embed_tokens.weight"
DRAFTER_FC = "fc.weight"


@pytest.fixture(autouse=True)
def no_drafter_env(monkeypatch):
    for name in ("DFLASH_HARVEST", "DFLASH_VT", "DFLASH_VT_TAU", "DFLASH_ADAPT", "DFLASH_MARKOV",
                 "DFLASH_VERIFY_BUDGET"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, tiny_drafter(target, block_size=4)


@pytest.fixture
def target_dir(tmp_path, pair):
    path = tmp_path / "target"
    checkpoints.write_target(path, pair[0], dtype="float32")
    return path


@pytest.fixture
def sharded_dir(tmp_path, pair):
    path = tmp_path / "sharded"
    checkpoints.write_target(path, pair[0], dtype="float32", shard_bytes=20_000)
    return path


@pytest.fixture
def drafter_dir(tmp_path, pair):
    path = tmp_path / "drafter"
    checkpoints.write_drafter(path, pair[1], dtype="float32")
    return path


def read_tensors(file):
    with _open(str(file)) as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def edit_tensors(folder, edit):
    """Apply `edit(dict of numpy arrays)` to a single-file checkpoint and save it back."""
    file = folder / SINGLE_FILE
    tensors = read_tensors(file)
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def write_raw_safetensors(file, tensors):
    """A safetensors file written byte by byte: name -> (safetensors dtype, shape, raw bytes), so that dtypes
    numpy cannot hold (float8) can be stored."""
    header, offset, data = {}, 0, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset, data = offset + len(raw), data + raw
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def edit_config(folder, edit):
    file = folder / "config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


def inspect(capsys, folder):
    code = cli.main(["inspect", str(folder)])
    out, err = capsys.readouterr()
    return code, out, err


def assert_params_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- item 1: shard paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("escape", ["../outside/evil.safetensors", "ABSOLUTE", "../../../../etc/passwd"])
def test_a_shard_path_leaving_the_folder_is_refused_by_load_and_by_inspect(tmp_path, sharded_dir, capsys, escape):
    """The escaping shard is a valid copy of the real one, so only the path check stands between the index and
    a silent load from outside the folder."""
    index = json.loads((sharded_dir / INDEX_FILE).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "outside" / "evil.safetensors"
    outside.parent.mkdir()
    shutil.move(sharded_dir / shard, outside)
    escape = str(outside) if escape == "ABSOLUTE" else escape
    index["weight_map"] = {n: escape if f == shard else f for n, f in index["weight_map"].items()}
    (sharded_dir / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder") as e:
        load_target(sharded_dir)
    assert escape in str(e.value)
    code, out, err = inspect(capsys, sharded_dir)
    assert code == 1 and out == "" and "outside the checkpoint folder" in err


def hf_cache_layout(src, root):
    """`src` laid out as the Hugging Face cache does: every file a blob under `root/blobs`, named by a relative
    symlink in `root/snapshots/rev` (`model.safetensors -> ../../blobs/<sha>`)."""
    snapshot, blobs = root / "snapshots" / "rev", root / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for entry in sorted(os.listdir(src)):
        data = (src / entry).read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", sha), snapshot / entry)
    return snapshot


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_symlinks_to_blobs_outside_the_folder_load_as_in_the_hugging_face_cache(tmp_path, pair, layout, capsys):
    src = tmp_path / "src"
    checkpoints.write_target(src, pair[0], dtype="float32", shard_bytes=20_000 if layout == "sharded" else None)
    snapshot = hf_cache_layout(src, tmp_path / "models--org--name")
    assert all(os.path.islink(snapshot / n) for n in os.listdir(snapshot))
    assert (INDEX_FILE in os.listdir(snapshot)) == (layout == "sharded")
    loaded = load_target(snapshot)
    assert_params_equal(loaded.params, pair[0].params)
    code, out, err = inspect(capsys, snapshot)
    assert code == 0 and "kind: target" in out, err


def test_a_drafter_in_the_hugging_face_cache_layout_loads(tmp_path, pair):
    src = tmp_path / "src"
    checkpoints.write_drafter(src, pair[1], dtype="float32", shard_bytes=20_000)
    snapshot = hf_cache_layout(src, tmp_path / "models--org--drafter")
    assert_params_equal(load_drafter(snapshot, pair[0]).params, pair[1].params)


# --- item 2: NaN and Inf weights -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_target_tensor_holding_nan_or_inf_is_refused_naming_file_tensor_and_count(target_dir, bad, dtype):
    name = "model.layers.1.mlp.down_proj.weight"

    def poison(t):
        t[name][0, :3] = bad

    edit_tensors(target_dir, poison)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor {name} has 3 non-finite value\(s\)") as e:
        load_target(target_dir, dtype)
    assert "check_finite=False" in str(e.value), "the refusal says how to load anyway"
    loaded = load_target(target_dir, dtype, check_finite=False)
    down = np.asarray(loaded.params["layers_1"]["w_down"])
    assert np.count_nonzero(~np.isfinite(down)) == 3, "switched off, the weights load as stored"


def test_a_drafter_tensor_holding_nan_is_refused(drafter_dir, pair):
    edit_tensors(drafter_dir, lambda t: t[DRAFTER_FC].__setitem__((1, 2), np.nan))
    with pytest.raises(CheckpointError, match=rf"tensor {DRAFTER_FC} has 1 non-finite value\(s\)"):
        load_drafter(drafter_dir, pair[0])
    assert load_drafter(drafter_dir, pair[0], check_finite=False).config.block_size == 4


def test_a_float32_value_beyond_the_float16_range_is_refused_when_loaded_in_float16(target_dir):
    edit_tensors(target_dir, lambda t: t[EMBED].__setitem__((0, 0), 1e6))
    assert np.isfinite(np.asarray(load_target(target_dir).params["embed"])).all()
    with pytest.raises(CheckpointError, match=rf"tensor {EMBED} has 1 non-finite .* in float16 \(stored as F32\)"):
        load_target(target_dir, dtype="float16")


# --- item 4: configs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["target", "drafter"])
@pytest.mark.parametrize("content, why", [(b"[1, 2]", "holds a JSON list"), (b"null", "holds a JSON NoneType"),
                                          (b'{"hidden_size": "\xff\xfe"}', "not UTF-8"),
                                          (b'"text"', "holds a JSON str")])
def test_a_config_json_that_is_not_an_object_of_utf8_text_is_refused(target_dir, drafter_dir, kind, content, why):
    folder = target_dir if kind == "target" else drafter_dir
    (folder / "config.json").write_bytes(content)
    load = load_target if kind == "target" else load_drafter
    with pytest.raises(CheckpointError, match=why) as e:
        load(folder)
    assert str(folder / "config.json") in str(e.value)


TARGET_CASES = [
    ("max_position_embeddings", 0), ("max_position_embeddings", -5), ("max_position_embeddings", "abc"),
    ("rms_norm_eps", -1e-6), ("rms_norm_eps", math.nan), ("rope_theta", -1.0), ("rope_theta", math.nan),
    ("rope_theta", math.inf), ("eos_token_id", "abc"), ("eos_token_id", [0, None]), ("eos_token_id", -1),
    ("tie_word_embeddings", "false"), ("attention_bias", "false"), ("num_key_value_heads", 0),
    ("architectures", "Qwen3ForCausalLM"), ("architectures", [["Qwen3ForCausalLM"]]), ("model_type", ["qwen3"]),
    ("layer_types", 5), ("use_sliding_window", "false"), ("rope_scaling", ["yarn"]),
]


@pytest.mark.parametrize("field, value", TARGET_CASES, ids=[f"{f}={v!r}" for f, v in TARGET_CASES])
def test_a_bad_target_config_field_is_refused_naming_the_file_and_the_field(target_dir, field, value):
    edit_config(target_dir, lambda d: d.update({field: value}))
    with pytest.raises(CheckpointError) as e:
        load_target(target_dir)
    message = str(e.value)
    assert field in message and str(target_dir / "config.json") in message, message


@pytest.mark.parametrize("value", [0, -2.0, "big", math.nan, None])
@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_a_bad_yarn_factor_is_refused_at_load_not_at_generate(target_dir, drafter_dir, kind, value):
    folder = target_dir if kind == "target" else drafter_dir
    edit_config(folder, lambda d: d.update(rope_scaling={"rope_type": "yarn", "factor": value,
                                                         "original_max_position_embeddings": 64}))
    with pytest.raises(CheckpointError, match="factor") as e:
        (load_target if kind == "target" else load_drafter)(folder)
    assert str(folder / "config.json") in str(e.value)


DRAFTER_CASES = [
    ("rms_norm_eps", math.nan), ("rms_norm_eps", -1.0), ("rope_theta", math.nan), ("vocab_size", "abc"),
    ("attention_bias", "false"), ("architectures", 5), ("layer_types", 5),
    ("dflash_config.input_embedding_scale", "abc"), ("dflash_config.output_multiplier", math.nan),
    ("dflash_config.final_logit_softcapping", "abc"), ("dflash_config.block_size", "4"),
    ("dflash_config.target_layer_ids", [0, None]), ("dflash_config", [0, None]),
]


@pytest.mark.parametrize("field, value", DRAFTER_CASES, ids=[f"{f}={v!r}" for f, v in DRAFTER_CASES])
def test_a_bad_drafter_config_field_is_refused_naming_the_file_and_the_field(drafter_dir, pair, field, value):
    def edit(d):
        *parent, key = field.split(".")
        (d[parent[0]] if parent else d)[key] = value

    edit_config(drafter_dir, edit)
    with pytest.raises(CheckpointError) as e:
        load_drafter(drafter_dir, pair[0])
    message = str(e.value)
    assert field.split(".")[-1] in message and str(drafter_dir / "config.json") in message, message


HOSTILE = ["abc", "false", -5, 0, 2.5, math.nan, math.inf, True, None, [0, None], {"a": 1}, [], ["x"]]


def _fields(config, nested_key):
    top = [(k,) for k in config if k != nested_key]
    nested = [(nested_key, k) for k in config.get(nested_key) or {}]
    return top + nested


def _each_corruption(config, nested_key, extra):
    for path in _fields(config, nested_key) + extra:
        for value in HOSTILE:
            bad = json.loads(json.dumps(config))
            (bad[path[0]] if len(path) == 2 else bad)[path[-1]] = value
            yield path, value, bad


def test_no_single_field_corruption_of_a_target_config_escapes_as_another_error(target_dir):
    """Every field (and every rope scaling parameter) set to each hostile value: the census either takes it or
    refuses it with a CheckpointError; never a TypeError, KeyError or a crash later on."""
    config = json.loads((target_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "truncate": True}
    extra = [("max_position_embeddings",), ("rms_norm_eps",), ("eos_token_id",), ("dtype",), ("mlp_bias",),
             ("layer_types",), ("rope_parameters",), ("partial_rotary_factor",)]
    refused = 0
    for path, value, bad in _each_corruption(config, "rope_scaling", extra):
        (target_dir / "config.json").write_text(json.dumps(bad))
        try:
            checkpoints.inspect_target(target_dir)
        except CheckpointError:
            refused += 1
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{'.'.join(path)}={value!r}: {type(e).__name__}: {e}")
    assert refused > 200, refused


def test_no_single_field_corruption_of_a_drafter_config_escapes_as_another_error(drafter_dir, pair):
    config = json.loads((drafter_dir / "config.json").read_text())
    extra = [("rms_norm_eps",), ("vocab_size",), ("attention_bias",), ("is_causal",), ("rope_scaling",),
             ("dflash_config", "input_embedding_scale"), ("dflash_config", "output_multiplier"),
             ("dflash_config", "final_logit_softcapping"), ("dflash_config", "num_target_layers"),
             ("dflash_config", "projector_type"), ("dflash_config", "markov_rank"),
             ("dflash_config", "enable_confidence_head")]
    refused = 0
    for path, value, bad in _each_corruption(config, "dflash_config", extra):
        (drafter_dir / "config.json").write_text(json.dumps(bad))
        try:
            checkpoints.inspect_drafter(drafter_dir, pair[0].config, env={})
        except CheckpointError:
            refused += 1
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{'.'.join(path)}={value!r}: {type(e).__name__}: {e}")
    assert refused > 200, refused


@pytest.mark.parametrize("weight_map, why", [
    (["model.safetensors"], "weight_map is"), ({EMBED: 5}, "must be shard file names"),
    ({EMBED: None}, "must be shard file names"), ({EMBED: ["a.safetensors"]}, "must be shard file names")])
def test_an_index_whose_weight_map_is_not_names_to_file_names_is_refused(sharded_dir, weight_map, why):
    index = json.loads((sharded_dir / INDEX_FILE).read_text())
    if isinstance(weight_map, dict):
        weight_map = {**index["weight_map"], **weight_map}
    (sharded_dir / INDEX_FILE).write_text(json.dumps({**index, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=why) as e:
        load_target(sharded_dir)
    assert str(sharded_dir / INDEX_FILE) in str(e.value)


def test_an_index_that_is_not_utf8_json_is_refused(sharded_dir):
    (sharded_dir / INDEX_FILE).write_bytes(b'{"weight_map": {"\xff": 1}}')
    with pytest.raises(CheckpointError, match="not UTF-8"):
        load_target(sharded_dir)


# --- item 5: tensor dtypes -------------------------------------------------------------------------------


@pytest.mark.parametrize("np_dtype, st_name", [(np.int32, "I32"), (np.int64, "I64"), (np.bool_, "BOOL"),
                                               (np.uint8, "U8")])
def test_an_integer_or_bool_tensor_where_a_float_weight_belongs_is_refused(target_dir, capsys, np_dtype, st_name):
    edit_tensors(target_dir, lambda t: t.update({EMBED: t[EMBED].astype(np_dtype)}))
    with pytest.raises(CheckpointError, match=rf"{EMBED} is {st_name} in .*model.safetensors.*supported: F32"):
        load_target(target_dir)
    code, _, err = inspect(capsys, target_dir)
    assert code == 1 and f"{EMBED} is {st_name}" in err, "inspect refuses it too, from the header alone"


@pytest.mark.parametrize("st_name, np_dtype", [("F8_E4M3", ml_dtypes.float8_e4m3fn),
                                               ("F8_E5M2", ml_dtypes.float8_e5m2)])
def test_a_float8_tensor_is_refused_by_name(target_dir, st_name, np_dtype):
    tensors = read_tensors(target_dir / SINGLE_FILE)
    raw = {n: ({np.dtype(np.float32): "F32"}[a.dtype], a.shape, a.tobytes()) for n, a in tensors.items()}
    raw[EMBED] = (st_name, tensors[EMBED].shape, tensors[EMBED].astype(np_dtype).tobytes())
    write_raw_safetensors(target_dir / SINGLE_FILE, raw)
    with pytest.raises(CheckpointError, match=rf"{EMBED} is {st_name} .*float8 checkpoints are quantized"):
        load_target(target_dir)


def test_a_float64_checkpoint_is_cast_to_float32_with_a_warning(tmp_path, pair):
    folder = tmp_path / "f64"
    checkpoints.write_target(folder, pair[0], dtype="float32")
    edit_tensors(folder, lambda t: t.update({n: a.astype(np.float64) for n, a in t.items()}))
    edit_config(folder, lambda d: d.update(torch_dtype="float64"))
    with pytest.warns(UserWarning, match=r"float64 tensor\(s\) .* cast to float32"):
        loaded = load_target(folder)
    assert loaded.config.dtype == "float32"
    assert {x.dtype for x in jax.tree.leaves(loaded.params)} == {jnp.dtype(jnp.float32)}
    assert_params_equal(loaded.params, pair[0].params)


# --- item 10: a drafter stored in another dtype than its target ------------------------------------------


def test_a_bfloat16_drafter_on_a_float32_target_computes_in_float32_and_decodes_losslessly(tmp_path, pair):
    target, drafter = pair
    folder = tmp_path / "bf16-drafter"
    checkpoints.write_drafter(folder, drafter, dtype="bfloat16")
    loaded = load_drafter(folder, target)
    prompts = [[5, 9, 13, 2], [7, 7, 21]]
    spec = generate(target, loaded, prompts, max_new_tokens=16)
    plain = generate(target, None, prompts, max_new_tokens=16)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0
    assert {x.dtype for x in jax.tree.leaves(loaded.params)} == {jnp.dtype(jnp.float32)}, "the target's dtype"
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), drafter.params)
    assert_params_equal(loaded.params, rounded)


def test_a_drafter_dtype_other_than_the_targets_is_refused_naming_both(drafter_dir, pair):
    with pytest.raises(CheckpointError, match="drafter dtype bfloat16 differs from the target's float32"):
        load_drafter(drafter_dir, pair[0], dtype="bfloat16")
    assert load_drafter(drafter_dir, pair[0], dtype="float32").config.block_size == 4
    alone = load_drafter(drafter_dir, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(alone.params)} == {jnp.dtype(jnp.bfloat16)}, "no target: as asked"
