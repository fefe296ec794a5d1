"""Engine node for the staged-path tests: :class:`kvxfer.bench.engine_node.EngineNode` plus methods
that report the staged statistics, inspect landing slots, and inject a raw scatter plan."""

from kvxfer.bench.engine_node import EngineNode, _result


class StagedNode(EngineNode):
    def write(self, key, peer_id, parts, notify=None, timeout=None):
        def go():
            st = self._peer(key, peer_id).write(self._writes(parts), notify, timeout)
            return {
                "bytes": st.bytes,
                "ops": st.ops,
                "lanes": st.lanes,
                "staged": st.staged,
                "staged_bytes": st.staged_bytes,
                "staged_direct_ops": st.staged_direct_ops,
            }

        return _result(go)

    def landing(self, key, peer_id, group):
        """(free, in flight) landing slots the peer granted us for ``group``."""
        land = self._peer(key, peer_id)._peer._staged.landing.get(group)
        return None if land is None else (land.free.qsize(), len(land.out))

    def landing_slots(self, key, peer_id, group):
        return list(self._peer(key, peer_id)._peer._staged.landing[group].slots)

    def engine_id(self, key):
        return self.engines[key].engine.id

    def granted(self, key, group):
        """Landing slots of ``group`` not granted to any peer."""
        return len(self.engines[key].engine._groups.stages[group]._grantable)

    def raw_plan(self, key, peer_id, group, slot, offset, nbytes, dst):
        """Send a hand-made StagedWrite straight over the channel."""
        import numpy as np

        from kvxfer.engine import messages as m

        sp = self._peer(key, peer_id)
        peer = sp._peer
        msg = m.StagedWrite(
            group=group,
            slot=slot,
            offset=offset,
            nbytes=nbytes,
            dst=np.asarray(dst, dtype="<i8").tobytes(),
        )

        async def go():
            await peer._channel.send(msg.encode(), 5.0)

        return _result(lambda: sp._owner._run(go(), 10.0))
