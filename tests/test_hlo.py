"""The HLO wire-byte parser on every replica-group syntax XLA prints."""

import pytest

from taco_jax.collectives.hlo import collective_bytes

pytestmark = pytest.mark.fast

LINES = {
    "list": "%a = f32[4,64]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
    "iota": "%b = u8[4,64]{1,0} all-gather(%x), replica_groups=[2,4]<=[8], dimensions={0}",
    "iota_t": "%c = f32[128]{0} all-reduce(%x), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add",
    "mesh": "%d = (f32[], f32[]) all-reduce(%x, %y), replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], "
            "device_ids=([2,4]T(1,0)) {'axis_0'}, to_apply=%add",
    "tuple": "%e = (u8[1,64,128]{2,1,0}, /*index=1*/u8[1,64,128]{2,1,0}) all-to-all(%p, %q), "
             "replica_groups={{0,1,2,3},{4,5,6,7}}",
    "permute": "%f = f32[8]{0} collective-permute(%x), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
}


@pytest.mark.parametrize(
    "name,axis,op,nbytes",
    [
        ("list", "tensor", "all-gather", 4 * 64 * 4 * 3 / 4),
        ("iota", "tensor", "all-gather", 4 * 64 * 3 / 4),
        ("iota_t", "data", "all-reduce", 2 * 128 * 4 / 2),
        ("mesh", "tensor", "all-reduce", 2 * 8 * 3 / 4),
        ("tuple", "tensor", "all-to-all", 2 * 64 * 128 * 3 / 4),
        ("permute", "tensor", "collective-permute", 32),
    ],
)
def test_parse(mesh, name, axis, op, nbytes):
    (row,) = collective_bytes(LINES[name], mesh)["detail"]
    assert (row["axis"], row["op"], row["bytes"]) == (axis, op, int(nbytes))


def test_named_scopes_name_taco_work_in_the_compiled_hlo():
    """Each compressed collective runs under `taco_<collective>`, its codec under `taco_encode` /
    `taco_decode` (op_name metadata: what a profile or an HLO dump shows)."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from taco_jax.codec import TACO
    from taco_jax.collectives import compressed

    mesh = Mesh(np.array(jax.devices()[:4]), ("tensor",))

    def body(x):
        y = compressed.psum(x, "tensor", codec=TACO)
        g = compressed.all_gather(x, "tensor", codec=TACO, tiled=True)
        s = compressed.psum_scatter(g, "tensor", codec=TACO)
        r = compressed.ppermute(2 * x, "tensor", [(i, (i + 1) % 4) for i in range(4)], codec=TACO)
        return y, s + r  # (2 * x: else XLA shares the all-gather's encode of x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=(P(), P("tensor"))))
    names = set(re.findall(r'op_name="([^"]*)"', f.lower(jnp.ones((32, 256))).compile().as_text()))
    for scope in ("taco_psum", "taco_all_gather", "taco_psum_scatter", "taco_ppermute"):
        assert any(f"/{scope}/taco_encode/" in n for n in names), scope
        assert any(f"/{scope}/taco_decode/" in n for n in names), scope
