# The seqstate pipeline (writer, projector, demo router) as one image; compose.yaml picks the
# subcommand. No ENTRYPOINT, so a compose `command: ["seqstate", "writer"]` runs as written.
#
# Two stages: setup.py compiles the hot modules of the core with mypyc unless SEQSTATE_PURE=1,
# and that needs a C compiler. The builder stage has build-essential and installs the package
# into a virtualenv; the final stage copies only that virtualenv, so the image keeps the
# compiled core (the faster fold, see BENCHMARKS.md) without carrying gcc. Both stages
# use the same base image, so the venv's interpreter path and ABI match.

FROM python:3.11-slim AS builder

RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

RUN python -m venv /opt/venv
ENV PATH="/opt/venv/bin:$PATH" \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY seqstate/ seqstate/
COPY projector/ projector/
# Not an editable install: the package (with its compiled modules) lands in /opt/venv.
RUN pip install --no-cache-dir . \
    && python -c "import seqstate.state as s; assert s.__file__.endswith('.so'), s.__file__"


FROM python:3.11-slim

COPY --from=builder /opt/venv /opt/venv
ENV PATH="/opt/venv/bin:$PATH" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

RUN useradd --create-home --uid 10001 --user-group seqstate
USER seqstate
WORKDIR /home/seqstate

CMD ["seqstate", "--help"]
