"""Stand-in generators and the test macro of rules_dsa: for tests and examples, never for shipping.

    load("@rules_dsa//rules:testing.bzl", "dsa_checkpoint", "dsa_py_test")

Real weights, trained LeRobot policies and Hub tokenizers cannot be downloaded in this repository's build, so
these rules write deterministic stand-ins (byte-identical on every machine, so a manifest pins them like real
files) that the real rules of rules/defs.bzl read exactly as they would read the real ones. Each has a
mnemonic of its own:

    manifest + model code ──DsaCheckpoint──► seeded .safetensors (or a sharded checkpoint)
    LeRobot config JSON ──DsaLeRobotPolicy──► NAME/config.json + NAME/model.safetensors
    policy directory (+ tokenizer) ──DsaLeRobotProcessors──► NAME/: pre- and post-processor files
    fixed corpus ──DsaLeRobotTokenizer──► NAME/tokenizer.json + tokenizer_config.json + special_tokens_map.json

`dsa_policy` (rules/defs.bzl) calls dsa_checkpoint or dsa_lerobot_policy itself when given no checkpoint, so
a BUILD file needs this file only to call them directly, or for `dsa_py_test`.
"""

load("//rules/private:pytest.bzl", _dsa_py_test = "dsa_py_test")
load(
    "//rules/private:stand_ins.bzl",
    _dsa_checkpoint = "dsa_checkpoint",
    _dsa_lerobot_policy = "dsa_lerobot_policy",
    _dsa_lerobot_processors = "dsa_lerobot_processors",
    _dsa_lerobot_tokenizer = "dsa_lerobot_tokenizer",
)

dsa_checkpoint = _dsa_checkpoint
dsa_lerobot_policy = _dsa_lerobot_policy
dsa_lerobot_processors = _dsa_lerobot_processors
dsa_lerobot_tokenizer = _dsa_lerobot_tokenizer

# `dsa_py_test(name, srcs, deps, data, args, python)`: a py_test that runs pytest on its sources (every test of
# this repository; `python` runs it under another dsa_python_env's interpreter).
dsa_py_test = _dsa_py_test
