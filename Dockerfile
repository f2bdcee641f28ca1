# One image for every hookline service; compose.yaml picks the command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY shared ./shared
COPY services ./services
COPY receiver ./receiver
COPY cli ./cli
# Local views (SQLite: dead letters, the monitor's statistics) live in a volume; lost, they are rebuilt.
RUN pip install -c constraints.txt . && useradd --system --uid 10001 hookline \
    && mkdir -p /var/lib/hookline && chown hookline /var/lib/hookline
ENV HOOKLINE_STATE_DIR=/var/lib/hookline
USER hookline
CMD ["hookline", "--help"]
