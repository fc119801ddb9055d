package vmm

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/sparse"
)

// The shim's side of memory snapshots: a guest restored from saved
// state, saved to files, its balloon's figures.

// restore runs the guest a memory snapshot saved: QEMU takes its device
// state (its RAM is the snapshot's copy already, skipped by the stream:
// x-ignore-shared), the guest goes on, and its agent, waiting since the
// snapshot, gets a new session and what it must change to be this
// sandbox (its clock, entropy, name and network).
func (v *vmm) restore(spec VMSpec) error {
	defer spec.State.Close()
	if _, err := v.qmp.do("migrate-set-capabilities", ignoreShared); err != nil {
		return err
	}
	if _, err := v.qmp.do("getfd", map[string]string{"fdname": "snapshot"}, int(spec.State.Fd())); err != nil {
		return err
	}
	if _, err := v.qmp.do("migrate-incoming", map[string]string{"uri": "fd:snapshot"}); err != nil {
		return err
	}
	if err := v.qmp.migrated(spec.BootTimeout); err != nil {
		return fmt.Errorf("load the snapshot's device state: %w", err)
	}
	if _, err := v.qmp.do("cont", nil); err != nil {
		return err
	}
	sess, err := v.link.Resync(spec.Restore.Nonce)
	if err != nil {
		return err
	}
	v.use(sess)
	g := spec.Guest
	g.Time = time.Now().UnixNano()
	_, err = v.ask(initproto.Request{Op: initproto.OpResume, ID: "#resume", Setup: &g})
	return err
}

// ignoreShared leaves the guest's shared memory out of a migration
// stream: its RAM (a file a snapshot copies on its own) and its layers
// (the pmem images, read-only).
var ignoreShared = map[string]any{"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": true}}}

// snapshot saves the guest, paused for as short a time as it takes:
// its agent quiesced (no command may run: their streams would end), the
// upper's file system frozen, QEMU stopped, its device state migrated
// to the request's first file and its RAM written to the second (a
// sparse image), the guest let go on, its disk's image written to the
// third while its file system is still frozen, and its agent given a
// new session (which thaws the file system, unless the worker froze it
// before: pack-diff reads it meanwhile). A snapshot that evicts the
// guest (req.Stop) leaves it stopped, and writes no disk. The reply
// says how long the guest was paused and the nonce a guest restored
// from the snapshot waits for.
func (v *vmm) snapshot(r initproto.Incoming) {
	defer closeAll(r.Files)
	fail := func(err error) { initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Error: err.Error()}) }
	if r.Req.Node != "" {
		v.snapshotFull(r, fail)
		return
	}
	if len(r.Files) != 3 && !(r.Req.Stop && len(r.Files) == 2) {
		fail(errors.New("a memory snapshot needs its state, RAM and disk files"))
		return
	}
	if v.spec.Disk == "" {
		fail(errors.New("this guest's shim knows no disk image (an older dsec started it): stop and start it first"))
		return
	}
	q, err := v.quiesce()
	if err != nil {
		fail(err)
		return
	}
	info := &initproto.SnapshotInfo{Nonce: q.Nonce}
	t0 := time.Now()
	err = v.save(r.Files[0], r.Files[1], info)
	if r.Req.Stop {
		if err == nil { // the guest never runs again: what it saved must last
			err = errors.Join(r.Files[0].Sync(), r.Files[1].Sync())
		}
		if err != nil {
			err = errors.Join(err, v.goOn(q))
			fail(err)
			return
		}
		zero := 0
		initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Exit: &zero, Snapshot: info})
		return
	}
	if _, cerr := v.qmp.do("cont", nil); err == nil {
		err = cerr
	}
	info.PausedNS = time.Since(t0).Nanoseconds()
	if err == nil {
		err = writeImage(r.Files[2], v.spec.Disk, &info.Disk)
	}
	if rerr := v.resumeAgent(q, !q.Frozen); err == nil {
		err = rerr
	}
	if err != nil {
		fail(err)
		return
	}
	zero := 0
	initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Exit: &zero, Snapshot: info})
}

// snapshotFull saves a full VM: its agent quiesced (its root's file
// system frozen), QEMU stopped, the empty image r.Req.Path stacked over
// its disk's top (node r.Req.Current, as node r.Req.Node: the ended top
// then holds the disk as the saved memory knows it), its device state
// and RAM migrated to the request's one file, the guest let go on over
// the new top and its agent given a new session (which thaws its root).
// An error that leaves the disk on its top (the image never opened)
// starts with notStackedPrefix.
func (v *vmm) snapshotFull(r initproto.Incoming, fail func(error)) {
	if len(r.Files) != 1 {
		fail(errors.New("a full VM's memory snapshot needs its state's file"))
		return
	}
	q, err := v.quiesce()
	if err != nil {
		fail(fmt.Errorf("%s%w", notStackedPrefix, err))
		return
	}
	info := &initproto.SnapshotInfo{Nonce: q.Nonce}
	t0 := time.Now()
	stacked := false
	err = func() error {
		if _, err := v.qmp.do("stop", nil); err != nil {
			return err
		}
		if err := v.diskSnapshot(r.Req.Current, r.Req.Node, r.Req.Path); err != nil {
			return err
		}
		stacked = true
		return v.migrateTo(r.Files[0])
	}()
	if _, cerr := v.qmp.do("cont", nil); cerr != nil {
		// A stopped guest would never answer its agent's resume.
		err = fmt.Errorf("the VM did not go on after its snapshot (%v; %v): stop and start the sandbox (its start keeps all its guest wrote)", err, cerr)
		if !stacked {
			err = fmt.Errorf("%s%w", notStackedPrefix, err)
		}
		fail(err)
		return
	}
	info.PausedNS = time.Since(t0).Nanoseconds()
	// Its root thawed whatever froze it: the worker holds no freeze of
	// a full VM's across a snapshot.
	if rerr := v.resumeAgent(q, true); err == nil {
		err = rerr
	}
	if err != nil {
		if !stacked {
			err = fmt.Errorf("%s%w", notStackedPrefix, err)
		}
		fail(err)
		return
	}
	zero := 0
	initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Exit: &zero, Snapshot: info})
}

// quiesce has the guest's agent freeze its file system and end its
// session, for a snapshot, once no command runs (their output streams
// would end); its answer holds the nonce the next session comes after.
func (v *vmm) quiesce() (initproto.Reply, error) {
	v.mu.Lock()
	n := len(v.running)
	v.mu.Unlock()
	if n > 0 {
		return initproto.Reply{}, fmt.Errorf("%d commands run in the guest: a memory snapshot waits for none (their output streams would end): %w", n, errdefs.ErrFailedPrecondition)
	}
	q, err := v.ask(initproto.Request{Op: initproto.OpQuiesce, ID: "#quiesce"})
	if err != nil {
		return q, fmt.Errorf("quiesce the guest: %w", err)
	}
	v.drop()
	return q, nil
}

// notStackedPrefix starts a full VM's snapshot's error that left its
// disk on the top it was on (QEMU never opened the image to stack).
const notStackedPrefix = "(disk unchanged) "

// migrateTo writes the stopped guest's device state and RAM to f, as
// fast as the disk takes it (QEMU's default bandwidth, 128 MiB/s, would
// hold the guest paused for seconds per GiB it touched).
func (v *vmm) migrateTo(f *os.File) error {
	if _, err := v.qmp.do("migrate-set-parameters", map[string]any{"max-bandwidth": int64(64) << 30}); err != nil {
		return err
	}
	// As restore takes it: the guest's shared memory (a microVM's RAM
	// file, its layers) is not in the stream; a full VM has none.
	if _, err := v.qmp.do("migrate-set-capabilities", ignoreShared); err != nil {
		return err
	}
	if _, err := v.qmp.do("getfd", map[string]string{"fdname": "snapshot"}, int(f.Fd())); err != nil {
		return err
	}
	if _, err := v.qmp.do("migrate", map[string]string{"uri": "fd:snapshot"}); err != nil {
		return err
	}
	if err := v.qmp.migrated(5 * time.Minute); err != nil {
		// Ended, not left to go on live once the guest goes on (and
		// stop it again, post-migrate, when it completes).
		v.qmp.do("migrate_cancel", nil)
		v.qmp.migrated(10 * time.Second)
		return fmt.Errorf("save the device state: %w", err)
	}
	return nil
}

// balloon is the guest's balloon device (microvm.Machine names it).
const balloon = "/machine/peripheral/balloon0"

// pollBalloon has QEMU ask the guest's balloon for its memory figures
// every 2 s (a restored guest's device state may not carry it).
func (v *vmm) pollBalloon() error {
	_, err := v.qmp.do("qom-set", map[string]any{"path": balloon, "property": "guest-stats-polling-interval", "value": 2})
	return err
}

// balloon sets the guest's memory to target bytes (0: all it was given),
// the balloon taking the rest: the guest gives up its caches first.
func (v *vmm) balloon(target int64) error {
	if target <= 0 {
		b, err := v.qmp.do("query-memory-size-summary", nil)
		if err != nil {
			return err
		}
		var sum struct {
			Base int64 `json:"base-memory"`
		}
		if err := json.Unmarshal(b, &sum); err != nil || sum.Base <= 0 {
			return fmt.Errorf("the guest's memory size: %s %v", b, err)
		}
		target = sum.Base
	}
	_, err := v.qmp.do("balloon", map[string]any{"value": target})
	return err
}

// guestMemory is what the guest's balloon last reported.
func (v *vmm) guestMemory() (*initproto.GuestMemory, error) {
	b, err := v.qmp.do("qom-get", map[string]any{"path": balloon, "property": "guest-stats"})
	if err != nil {
		return nil, err
	}
	var st struct {
		Stats map[string]int64 `json:"stats"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("the balloon's figures: %w", err)
	}
	m := &initproto.GuestMemory{Total: st.Stats["stat-total-memory"], Available: st.Stats["stat-available-memory"]}
	if m.Total <= 0 || m.Available < 0 {
		return nil, errors.New("the guest's balloon reported no figures yet")
	}
	if b, err := v.qmp.do("query-balloon", nil); err == nil {
		var q struct {
			Actual int64 `json:"actual"`
		}
		if json.Unmarshal(b, &q) == nil {
			m.Actual = q.Actual
		}
	}
	return m, nil
}

// goOn lets a guest a failed eviction stopped run on.
func (v *vmm) goOn(q initproto.Reply) error {
	_, err := v.qmp.do("cont", nil)
	return errors.Join(err, v.resumeAgent(q, !q.Frozen))
}

// resumeAgent gives the agent a quiesce ended its session a new one,
// and lets it go on as it was, its file system thawed with thaw (a
// microVM's stays frozen if it was before: the worker froze it).
func (v *vmm) resumeAgent(q initproto.Reply, thaw bool) error {
	sess, err := v.link.Resync(q.Nonce)
	if err != nil {
		return err
	}
	v.use(sess)
	_, err = v.ask(initproto.Request{Op: initproto.OpResume, ID: "#resume", Setup: &initproto.GuestSpec{Time: time.Now().UnixNano(), Thaw: thaw}})
	return err
}

// save stops QEMU and writes the guest's device state, and its RAM if
// it is a file (else the state holds it).
func (v *vmm) save(state, ram *os.File, info *initproto.SnapshotInfo) error {
	if _, err := v.qmp.do("stop", nil); err != nil {
		return err
	}
	if err := v.migrateTo(state); err != nil {
		return err
	}
	if v.ram == nil {
		return nil
	}
	st, err := sparse.Write(ram, v.ram)
	if err != nil {
		return fmt.Errorf("write the guest's memory: %w", err)
	}
	info.RAM = st
	return nil
}

// writeImage writes the sparse image of the file src to dst.
func writeImage(dst *os.File, src string, st *sparse.Stats) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	if *st, err = sparse.Write(dst, f); err != nil {
		return fmt.Errorf("write the guest's disk: %w", err)
	}
	return nil
}
