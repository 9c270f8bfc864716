"""What the prompt cache tests share: walking a PromptCache's tree, and the bytes it
holds counted from its nodes (the arrays, and the host's part per node and handle), to
compare with its own account (`nbytes`)."""

from __future__ import annotations

from monolith.runtime.prompt_cache import HANDLE_BYTES, NODE_BYTES, PromptCache


def nodes(pc: PromptCache):
    found, stack = [], list(pc.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        found.append(node)
    return found


def held_bytes(pc: PromptCache) -> int:
    total = 0
    for node in nodes(pc):
        arrays = [a for pair in node.rows + list(node.state.states if node.state else ()) for a in pair]
        total += sum(a.nbytes for a in arrays)
        total += 4 * len(node.tokens) + NODE_BYTES + HANDLE_BYTES * len(arrays)  # the host's part
    return total
