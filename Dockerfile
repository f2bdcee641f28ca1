# One image for every hookline service; compose.yaml picks the command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install -c constraints.txt . && useradd --system --uid 10001 hookline
USER hookline
CMD ["hookline", "--help"]
