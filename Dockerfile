# GPU image: vLLM's official OpenAI server image with vllm-kvq built into it (C++ and CUDA
# kernels). The server is `vllm-kvq serve`, i.e. `vllm serve` with our backend and routes.
#
#   docker build -t vllm-kvq:gpu .
#   docker run --rm --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#       vllm-kvq:gpu Qwen/Qwen2.5-7B-Instruct --kv-method kivi2 --host 0.0.0.0
#
# The install steps are scripts/install.sh's: the very ones scripts/setup.sh runs on the
# CPU; here vLLM and CUDA torch come with the base image, so only the build tools are added.
ARG VLLM_VERSION=v0.32.0
FROM vllm/vllm-openai:${VLLM_VERSION}

# the SM targets to compile for (setup.py reads KVQ_CUDA_ARCHS); 80 = A100, 90 = H100/H200
ARG KVQ_CUDA_ARCHS=80,90
ENV KVQ_CUDA_ARCHS=${KVQ_CUDA_ARCHS} \
    PY=python3 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/vllm-kvq/src
COPY requirements/gpu.txt requirements/gpu.txt
COPY scripts/install.sh scripts/install.sh
RUN bash scripts/install.sh requirements requirements/gpu.txt

COPY setup.py ./
COPY csrc csrc
COPY vllm_kvq vllm_kvq
RUN bash scripts/install.sh package \
    && KVQ_REQUIRE_CUDA=1 bash scripts/install.sh check

EXPOSE 8000
ENTRYPOINT ["vllm-kvq", "serve"]
