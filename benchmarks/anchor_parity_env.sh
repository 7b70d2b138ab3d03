#!/usr/bin/env bash
# Build the pinned environment benchmarks/anchor_parity.py and benchmarks/ttt_vs_specforge.py run in: the anchor
# implementations (SpecForge for DFlash and its EAGLE3 trainer, speculators for P-EAGLE) installed from PyPI the way
# a user installs them, not eaglet's own venv, so the checks compare against the released wheels.
#
#   benchmarks/anchor_parity_env.sh [DIR]        # DIR defaults to <repo>/.venv-anchors
#   PYTHONPATH=. DIR/bin/python benchmarks/anchor_parity.py
#
# eaglet is never installed here: the check imports its models/ from the repository through PYTHONPATH (they need
# only torch, so they run under the anchors' transformers pin).
#
# Why --no-deps for the anchors: specforge 0.2.0 declares torch==2.11.0, sglang and CUDA-only extras, and
# speculators 0.9.0 torchvision/torchaudio; none of them is imported by the training objectives this check calls
# on CPU, and each would replace or add a multi-GB torch build. Their import-time dependencies are installed
# instead, every one pinned (the versions this check was last verified with) by a constraints file, which also
# pins what torch and transformers pull in, so a rebuild resolves to the same set.
# torch is pinned to 2.13.0 (eaglet's). Where PyPI's torch==2.13.0 is a CUDA build (Linux x86), set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu: it is added as an extra index for the torch install only,
# and pip then prefers 2.13.0+cpu (a local version sorts above the plain one).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$REPO/.venv-anchors}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$DIR/bin/python" ]]; then
    "$PYTHON" -m venv "$DIR"
fi
PIP=("$DIR/bin/python" -m pip install --disable-pip-version-check)

PINS="$DIR/anchor-pins.txt"
cat >"$PINS" <<'EOF'
torch==2.13.0
transformers==5.8.1
specforge==0.2.0
speculators==0.9.0
hs-connectors==0.9.0
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
attrs==26.1.0
certifi==2026.10.19.post1
click==8.5.1
datasets==5.1.0
dill==0.4.1
filelock==4.3.2
frozenlist==1.8.0
fsspec==2026.7.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpcore2==2.17.0
httpx==0.29.0
httpx2==2.17.0
huggingface_hub==1.33.0
idna==3.21
Jinja2==3.1.6
jiter==0.19.0
loguru==0.7.3
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
mpmath==1.3.0
multidict==7.2.1
multiprocess==0.70.19
networkx==3.6.1
numpy==2.4.6
openai==3.63.0
packaging==26.4
pandas==3.1.1
propcache==0.5.4
protobuf==7.36.2
psutil==7.2.2
pyarrow==26.0.1
pydantic==2.14.4
pydantic-settings==2.16.3
pydantic_core==2.50.5
Pygments==2.21.0
python-dateutil==4.0.0
python-dotenv==1.2.4
PyYAML==6.0.4
regex==2026.12.2
rich==15.0.0
safetensors==0.8.0
setuptools==84.2.1
shellingham==1.5.4
sniffio==1.3.1
sympy==1.14.0
tokenizers==0.22.2
tqdm==4.70.1
triton==3.9.0
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
tzdata==2026.6
xxhash==4.1.0
yarl==1.25.1
EOF

"${PIP[@]}" torch==2.13.0 -c "$PINS" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
# transformers for SpecForge's DFlash; the rest is what importing speculators needs (its package __init__ loads
# its data and training modules: datasets, openai, hs-connectors, ...).
"${PIP[@]}" -c "$PINS" transformers safetensors \
    aiohttp click datasets httpx huggingface-hub loguru numpy openai protobuf psutil pydantic pydantic-settings \
    rich tqdm typer hs-connectors
"${PIP[@]}" --no-deps specforge==0.2.0 speculators==0.9.0
# specforge's EAGLE3 loss module imports triton at module level (its kernel needs a GPU; on CPU
# benchmarks/ttt_vs_specforge.py runs SpecForge's own reference loss in its place): the import must succeed.
"${PIP[@]}" --no-deps -c "$PINS" triton

# Fail now, not in the check, when the anchors or eaglet's models cannot be imported from this environment.
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$DIR/bin/python" -W ignore - <<'EOF'
import torch, transformers
import specforge.algorithms.common.dflash_family_model  # noqa: F401
import speculators.models.peagle.core  # noqa: F401
import specforge.algorithms.eagle3.model  # noqa: F401  (benchmarks/ttt_vs_specforge.py)
import models.dflash_objective, models.ttt  # noqa: F401  (eaglet, from the repository)
from importlib.metadata import version
print(f"anchor env ready: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"specforge {version('specforge')}, speculators {version('speculators')}")
EOF
