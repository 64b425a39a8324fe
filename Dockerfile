# sisrl retriever: builds an index from a mounted corpus on first start, then serves it (docker-compose.yml).
# CPU image; for GPUs start from a CUDA base and install the `gpu` extra (faiss-gpu) instead of faiss-cpu.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SISRL_CACHE=/cache \
    HF_HUB_OFFLINE=1

WORKDIR /app
# The CPU wheel of torch first (the default PyPI wheel pulls CUDA libraries the image does not need).
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<3"
COPY pyproject.toml README.md ./
# Every part's folder is copied (one package list), but only the retriever's dependencies are installed.
COPY common ./common
COPY retriever ./retriever
COPY services ./services
COPY trainer ./trainer
RUN pip install '.[retriever]'

# Unprivileged user; /data holds corpus and index, /cache the converted offline encoder.
RUN useradd --create-home --uid 1000 sisrl && mkdir -p /data /cache && chown sisrl /data /cache
USER sisrl
VOLUME ["/data", "/cache"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# Inside the container the server must listen on all interfaces for the published port to reach it.
ENTRYPOINT ["sisrl-retriever"]
CMD ["serve", "--index", "/data/index", "--corpus", "/data/corpus.jsonl", "--host", "0.0.0.0", "--port", "8000"]
