"""Features captured while decoding (`DecodingState.prefill(capture=True)`, `take_features`) equal a fresh extraction's.

The property: for every committed token that went through a target forward (the prompt at prefill, then each
round's root and accepted tokens), the captured aux layers and last hidden state equal what one full-sequence
forward of prompt + answer (`eagle_core.capture.capture_features`, the extraction's forward) computes at that
position. Incremental and full-sequence forwards sum in different orders, so fp32 agrees to rounding: the error is
measured per position as max |captured - extracted| / max |extracted| (over the 3H aux or H last-hidden values of
that position), and its maximum over every position, row and layer must stay under 1e-5. The answer tokens are
transformers' greedy `generate`'s. bf16 is held to the tolerance of the other bf16 comparisons (test_draft.py:
rtol = atol = 0.05). Batch 1 and a ragged batch whose rows have different prompt lengths and leave at different
times, through tree, chain and plain rounds.
"""

import pytest
import torch

from decode_helpers import echo_draft, random_draft, random_prompts
from eagle_core.capture import capture_features
from eagle_core.decoding import DecodingState
from eagle_core.target import default_aux_layer_ids, make_tiny_llama
from eagle_core.tree import TreeConfig
from eagle_core.verify import SamplingConfig

FP32_REL = 1e-5
MEASURED: dict[str, float] = {}  # the max relative errors, printed at the end of the module (pytest -s)


def decode_capturing(target, draft, prompts, max_new: list[int], modes, tree=TreeConfig(4, 4, 12)):
    """Greedy decoding of `prompts` with capture on; rows leave once they have their max_new tokens. Returns
    per row (answer tokens, aux [n, 3H], last [n, H]) with the features of the committed tokens taken round by
    round (a leaving row's are taken before it leaves)."""
    state, step = DecodingState.prefill(target, draft, prompts, SamplingConfig(), tree, capture=True)
    answers = [[] for _ in prompts]
    chunks = [[] for _ in prompts]
    active = list(range(len(prompts)))
    round_ = 0
    while True:
        for row, i in enumerate(active):
            answers[i] += step.tokens[row]
        for row, got in zip(active, state.take_features()):
            if got is not None:
                chunks[row].append(got)
        keep = [row for row, i in enumerate(active) if len(answers[i]) < max_new[i]]
        if not keep:
            break
        state.select_rows_(keep)
        active = [active[row] for row in keep]
        step = state.step(modes[round_ % len(modes)])
        round_ += 1
    out = []
    for i, prompt in enumerate(prompts):
        answer = answers[i][: max_new[i]]
        aux = torch.cat([c.aux_hidden for c in chunks[i]])
        last = torch.cat([c.last_hidden for c in chunks[i]])
        # every committed token but the final bonus went through a forward (a round may go past max_new)
        assert len(aux) >= len(prompt) + len(answer) - 1
        out.append((answer, aux, last))
    return out


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max over positions of max |got - ref| / max |ref| at that position."""
    got, ref = got.double(), ref.double()
    return float(((got - ref).abs().amax(-1) / ref.abs().amax(-1)).max())


def check_against_extraction(target, prompts, decoded, aux_layer_ids, label, rel=FP32_REL, bf16=False):
    worst = 0.0
    for prompt, (answer, aux, last) in zip(prompts, decoded):
        sequence = prompt + answer
        ref = capture_features(target, torch.tensor([sequence]), aux_layer_ids=aux_layer_ids)
        n = len(sequence) - 1  # the final token is a bonus: no forward processed it
        got_aux, got_last = aux[:n], last[:n]
        assert got_aux.dtype == ref.aux_hidden.dtype == target.dtype
        if bf16:
            torch.testing.assert_close(got_aux.float(), ref.aux_hidden[0, :n].float(), rtol=0.05, atol=0.05)
            torch.testing.assert_close(got_last.float(), ref.last_hidden[0, :n].float(), rtol=0.05, atol=0.05)
        worst = max(worst, relative_error(got_aux, ref.aux_hidden[0, :n]),
                    relative_error(got_last, ref.last_hidden[0, :n]))
    MEASURED[label] = worst
    if not bf16:
        assert worst < rel, f"{label}: captured features differ from the extraction's by {worst:.2e} relative"
    return worst


@torch.inference_mode()
def hf_greedy(target, prompt, n):
    out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama().eval()


@pytest.mark.parametrize("kind", ["echo", "random"])
@torch.inference_mode()
def test_tiny_fp32_capture_equals_extraction_and_answers_equal_hf(tiny, kind):
    """fp32 tiny Llama, a hand-set draft with long accepted paths (echo) and a random one (mostly nothing
    accepted): batch 1, then a ragged batch of 3 whose rows leave at 9, 14 and 20 tokens, rounds cycling through
    tree, plain and chain (a plain step's features are its root's; deferred draft inputs change nothing)."""
    draft = echo_draft(tiny) if kind == "echo" else random_draft(tiny, 512)
    prompts = random_prompts(3, 512, lo=4, hi=24, seed=2)
    assert len({len(p) for p in prompts}) == 3
    aux_ids = default_aux_layer_ids(tiny.config.num_hidden_layers)
    alone = decode_capturing(tiny, draft, prompts[:1], [20], ["tree"])
    check_against_extraction(tiny, prompts[:1], alone, aux_ids, f"tiny fp32 {kind} batch 1")
    batch = decode_capturing(tiny, draft, prompts, [9, 14, 20], ["tree", "plain", "chain"])
    check_against_extraction(tiny, prompts, batch, aux_ids, f"tiny fp32 {kind} ragged 3")
    for prompt, (answer, _, _) in zip(prompts, batch):
        assert answer == hf_greedy(tiny, prompt, len(answer))
    assert batch[0][0] == alone[0][0][:9]


@torch.inference_mode()
def test_capture_follows_rows_that_join_and_custom_layers(tiny):
    """A row prefilled alone and merged into a running batch keeps its own features; layers other than the
    draft's (here [1, 3, 5] against the draft's default [2, 3, 3]) are recorded too."""
    draft = echo_draft(tiny)
    prompts = random_prompts(2, 512, lo=5, hi=15, seed=5)
    aux_ids = [1, 3, 5]
    state, first = DecodingState.prefill(tiny, draft, prompts[:1], SamplingConfig(), TreeConfig(4, 4, 12),
                                         capture=aux_ids)
    answers, chunks = [first.tokens[0]], [state.take_features()]
    step = state.step("tree")
    answers[0] += step.tokens[0]
    chunks.append(state.take_features())
    other, joined = DecodingState.prefill(tiny, draft, prompts[1:], SamplingConfig(), TreeConfig(4, 4, 12),
                                          capture=aux_ids)
    state.merge_(other)
    answers.append(joined.tokens[0])
    for _ in range(3):
        step = state.step("tree")
        answers[0] += step.tokens[0]
        answers[1] += step.tokens[1]
        chunks.append(state.take_features())
    decoded = []
    for row in range(2):
        got = [c[row] for c in chunks if row < len(c) and c[row] is not None]
        decoded.append((answers[row], torch.cat([g.aux_hidden for g in got]), torch.cat([g.last_hidden for g in got])))
    # row 1's first chunk is its prompt, taken from the merged state: its prefill features moved with it
    check_against_extraction(tiny, prompts, decoded, aux_ids, "tiny fp32 merged row, layers [1, 3, 5]")
    with pytest.raises(ValueError, match="does not capture"):
        DecodingState.prefill(tiny, draft, prompts[:1], SamplingConfig(), TreeConfig(4, 4, 12))[0].take_features()


@torch.inference_mode()
def test_capture_off_keeps_nothing(tiny):
    state, _ = DecodingState.prefill(tiny, echo_draft(tiny), random_prompts(1, 512, seed=1), SamplingConfig(),
                                     TreeConfig(4, 4, 12))
    state.step("tree")
    assert state.kv.features is None
    capturing, _ = DecodingState.prefill(tiny, echo_draft(tiny), random_prompts(1, 512, seed=1), SamplingConfig(),
                                         TreeConfig(4, 4, 12), capture=True)
    with pytest.raises(ValueError, match="captures features"):
        state.merge_(capturing)


@torch.inference_mode()
def test_tiny_bf16_capture_within_bf16_tolerance():
    target = make_tiny_llama(dtype=torch.bfloat16).eval()
    draft = echo_draft(target)
    prompts = random_prompts(2, 512, lo=4, hi=24, seed=3)
    aux_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    decoded = decode_capturing(target, draft, prompts, [12, 16], ["tree", "plain"])
    check_against_extraction(target, prompts, decoded, aux_ids, "tiny bf16 ragged 2", bf16=True)


@pytest.mark.slow
@torch.inference_mode()
def test_smollm2_capture_with_the_shipped_draft_equals_extraction(smollm2):
    """The real SmolLM2 in fp32 with the shipped draft: one short chat turn alone, then beside a shorter one."""
    from eagle_core.chat import prompt_ids
    from eagle_core.checkpoint import load_draft
    from eagle_core.shipped import shipped_draft

    model, tokenizer = smollm2
    draft = load_draft(shipped_draft(), target=model).eval()
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": "Name three primary colors."}]),
               prompt_ids(tokenizer, [{"role": "user", "content": "What is 2 + 2?"}])]
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    alone = decode_capturing(model, draft, prompts[:1], [10], ["tree"])
    check_against_extraction(model, prompts[:1], alone, aux_ids, "smollm2 fp32 batch 1")
    batch = decode_capturing(model, draft, prompts, [10, 6], ["tree", "tree", "plain"])
    check_against_extraction(model, prompts, batch, aux_ids, "smollm2 fp32 ragged 2")
    assert batch[0][0] == alone[0][0]
    assert alone[0][0] == hf_greedy(model, prompts[0], 10)
    assert batch[1][0] == hf_greedy(model, prompts[1], 6)


def teardown_module():
    for label, value in MEASURED.items():
        print(f"[traffic-capture] {label}: max relative error {value:.2e}")
