# One image for every pgbroker / ticketflow service of docker-compose.yml.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

WORKDIR /app
COPY . /app
# The admin extra: the admin service runs `pgbroker serve` from this image too.
RUN pip install '.[admin]' \
    && useradd --create-home --uid 10001 app \
    && chown app /app

# Celery warns when run as root: run as an ordinary user (who may write in /app, e.g. beat's files).
USER app
CMD ["pgbroker", "--help"]
