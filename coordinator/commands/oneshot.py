"""One prompt, one answer, no server: `metal-cluster generate`. Drives the stage interface with the
simplest possible schedule (prefill the prompt, then decode one token per step)."""

from collections.abc import Iterator

from mlx_lm.utils import load_tokenizer

from metal_cluster.coordinator.cluster.stages import LocalStage
from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.stage_worker.model.model_source import ModelSource

BLOCK_SIZE = 16


def generate(source: ModelSource, prompt: str, max_tokens: int, chat: bool = True) -> Iterator[str]:
    tokenizer = load_tokenizer(source.folder)
    if chat and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        ids = tokenizer.encode(prompt)
    num_blocks = 1 + -(-(len(ids) + max_tokens) // BLOCK_SIZE)
    stage = LocalStage()
    num_layers = source.config["num_hidden_layers"]
    stage.assign(pb.AssignRequest(version=PROTO_VERSION, model=str(source.folder), layer_start=0,
                                  layer_end=num_layers, block_size=BLOCK_SIZE))
    stage.start(pb.StartRequest(version=PROTO_VERSION, num_blocks=num_blocks, world_size=1))
    detok = tokenizer.detokenizer
    detok.reset()
    step = pb.StepRequest(version=PROTO_VERSION, step_id=0)
    step.new_requests.append(pb.NewRequest(req_id="0", prompt_token_ids=ids, block_ids=range(1, num_blocks)))
    step.scheduled.append(pb.ScheduledTokens(req_id="0", num_tokens=len(ids)))
    for i in range(max_tokens):
        token = stage.submit(step).result().sampled[0].token_id
        if token in tokenizer.eos_token_ids:
            break
        detok.add_token(token)
        yield detok.last_segment
        step = pb.StepRequest(version=PROTO_VERSION, step_id=i + 1)
        step.cached_requests.append(pb.CachedRequest(req_id="0", num_computed_tokens=len(ids) + i, new_token_ids=[token]))
        step.scheduled.append(pb.ScheduledTokens(req_id="0", num_tokens=1))
    detok.finalize()
    yield detok.last_segment
