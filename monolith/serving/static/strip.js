// The live strip under the conversation: tokens per round (acceptance length),
// acceptance per draft position, tok/s, and the prompt-cache hits of the turn. From the
// final chunk's `monolith.stats` when the server sent them, else counted from the
// speculation pieces so far and the usage.

const $ = (id) => document.getElementById(id);

// Rounds counted from the pieces: each drafted round is accepted pieces closed by a
// correction or a bonus token; a plain piece is a step without a draft.
export function roundsOf(pieces) {
  const perPosition = [];
  let rounds = 0, drafted = 0, position = 0;
  for (const piece of pieces || []) {
    if (piece.how === "accepted") {
      perPosition[position] = (perPosition[position] || 0) + 1;
      position += 1;
      drafted += 1;
    } else if (piece.how === "correction" || piece.how === "bonus") {
      rounds += 1;
      drafted += 1;
      position = 0;
    }
  }
  return { rounds, accepted_per_position: Array.from(perPosition, (n) => n || 0),
           acceptance_length: rounds ? drafted / rounds : null };
}

function decodeSpeed(message) {
  const stats = message.stats || {};
  if (stats.spec?.decode_tok_s) return stats.spec.decode_tok_s;
  const timing = message.timing || {};
  const tokens = stats.usage?.completion_tokens ?? (message.spec?.length || message.chunks || 0);
  const seconds = ((timing.last || 0) - (timing.first || 0)) / 1000;
  return tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null;
}

function drawPositions(el, perPosition, rounds) {
  el.replaceChildren();
  perPosition.forEach((count, j) => {
    const bar = document.createElement("span");
    bar.className = "bar";
    const share = rounds ? count / rounds : 0;
    bar.style.height = `${Math.max(1, Math.round(share * 20))}px`;
    bar.title = `position ${j + 1}: ${(share * 100).toFixed(0)}% of rounds`;
    el.append(bar);
  });
}

function cacheText(message) {
  const spec = message.stats?.spec;
  const usage = message.stats?.usage;
  const prompt = spec?.prompt_tokens ?? usage?.prompt_tokens;
  const cached = spec?.cached_tokens ?? usage?.prompt_tokens_details?.cached_tokens;
  return prompt ? `prompt cache: ${cached ?? 0}/${prompt} tokens` : "";
}

// Shows the strip for `message` (the turn streaming or the last one), or hides it
export function showStrip(message) {
  const strip = $("strip");
  if (!message || message.role !== "assistant") {
    strip.hidden = true;
    return;
  }
  strip.hidden = false;
  const spec = message.stats?.spec || (message.spec?.length ? roundsOf(message.spec) : null);
  const length = spec?.acceptance_length;
  $("strip-round").textContent = length ? `${length.toFixed(2)} tokens/round (${spec.rounds} rounds)`
    : spec ? "no drafted rounds" : "no speculation detail from this server";
  drawPositions($("strip-positions"), spec?.accepted_per_position || [], spec?.rounds || 0);
  const speed = decodeSpeed(message);
  $("strip-speed").textContent = speed ? `${speed.toFixed(1)} tok/s` : "";
  $("strip-cache").textContent = cacheText(message);
}
