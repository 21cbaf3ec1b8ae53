"""scripts/compiled_bytes.py reads a compiled module as XLA prints it: each op's operand and
result bytes, the computations a call runs walked where it runs them, and the ops that move
nothing (parameters, tuples, bitcasts) left out."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("compiled_bytes",
                                               ROOT / "scripts" / "compiled_bytes.py")
compiled_bytes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled_bytes)

MODULE = """\
HloModule jit_f

%fused_add (p0: f32[4,8], p1: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[4,8]{1,0} parameter(1)
  ROOT %add.1 = f32[4,8]{1,0} add(%p0, %p1)
}

%called (q0: bf16[16]) -> f8e4m3fn[16] {
  %q0 = bf16[16]{0} parameter(0)
  ROOT %convert.2 = f8e4m3fn[16]{0} convert(%q0), metadata={op_name="jit(f)/convert"}
}

ENTRY %main (a: f32[4,8], b: f32[4,8], c: bf16[16]) -> (f32[4,8], f8e4m3fn[16]) {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[4,8]{1,0} parameter(1)
  %c = bf16[16]{0} parameter(2)
  %loop_add_fusion = f32[4,8]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_add
  %call-start = ((bf16[16]), f8e4m3fn[16]) call-start(%c), to_apply=%called
  %call-done = f8e4m3fn[16]{0} call-done(%call-start)
  %cc = (s32[2]{0}, pred[]) custom-call(%a), custom_call_target="jax_ep_local_layout"
  ROOT %tuple = (f32[4,8]{1,0}, f8e4m3fn[16]{0}) tuple(%loop_add_fusion, %call-done)
}
"""


def test_array_bytes_counts_each_shape_of_a_tuple():
  assert compiled_bytes.array_bytes("(f32[4,8]{1,0}, f8e4m3fn[16], pred[], s32[2])") == 128 + 16 + 1 + 8


def test_each_op_moves_its_operands_and_results():
  rows = compiled_bytes.ops(MODULE)
  assert [(label.split()[0], moved) for label, _, moved in rows] == [
      ("fusion", 3 * 128),        # two f32[4,8] in, one out
      ("convert", 16 * 2 + 16),   # the called computation's op, where the call runs it
      ("custom-call", 128 + 9),   # f32[4,8] in; s32[2] and pred[] out
  ]
  assert rows[2][0] == "custom-call jax_ep_local_layout"
