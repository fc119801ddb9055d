package policy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// The network allowlist is enforced by four cgroup programs on the
// sandbox's cgroup2 directory, connect4, connect6, sendmsg4 and sendmsg6,
// which look the destination up in an LPM trie of Entries (IPv4 as
// IPv4-mapped IPv6, so an IPv6 socket to ::ffff:a.b.c.d meets the IPv4
// rules) and return 0 (EPERM) unless a port rule allows it. The trie
// hangs in slot 0 of an array of maps: an update builds a new trie and
// swaps it in with one map write, so a connect sees the old list or the
// new, never half of one. The programs are attached with BPF_PROG_ATTACH
// and no flags: they stay with the cgroup without a pinned link or a
// process holding them (the worker may die; the sandbox runs on), no
// program in a sub-cgroup can override them, and removing the cgroup
// detaches them.

var netAttach = []ebpf.AttachType{
	ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect,
	ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupUDP6Sendmsg,
}

const (
	keySize      = 4 + 16
	valueSize    = 4 + 8*MaxPortRules
	trieCapacity = 1 << 17
)

// struct bpf_sock_addr offsets.
const (
	ctxUserIP4  = 4
	ctxUserIP6  = 8
	ctxUserPort = 24
	ctxType     = 32
)

func trieSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{Name: "dsec_allow", Type: ebpf.LPMTrie, KeySize: keySize, ValueSize: valueSize,
		MaxEntries: trieCapacity, Flags: unix.BPF_F_NO_PREALLOC}
}

// program is the allowlist check for one hook.
func program(outer *ebpf.Map, v6 bool) asm.Instructions {
	ins := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		// The key, at fp-20: prefix length 128, then the address.
		asm.StoreImm(asm.RFP, -20, 128, asm.Word),
	}
	if v6 {
		for i := int16(0); i < 4; i++ {
			ins = append(ins,
				asm.LoadMem(asm.R0, asm.R6, ctxUserIP6+4*i, asm.Word),
				asm.StoreMem(asm.RFP, -16+4*i, asm.R0, asm.Word))
		}
	} else {
		ins = append(ins,
			asm.StoreImm(asm.RFP, -16, 0, asm.Word),
			asm.StoreImm(asm.RFP, -12, 0, asm.Word),
			// bytes 00 00 ff ff
			asm.StoreImm(asm.RFP, -8, int64(int32(binary.NativeEndian.Uint32([]byte{0, 0, 0xff, 0xff}))), asm.Word),
			asm.LoadMem(asm.R0, asm.R6, ctxUserIP4, asm.Word),
			asm.StoreMem(asm.RFP, -4, asm.R0, asm.Word))
	}
	ins = append(ins,
		// The trie: outer[0].
		asm.StoreImm(asm.RFP, -24, 0, asm.Word),
		asm.LoadMapPtr(asm.R1, outer.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -24),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "deny"),
		asm.Mov.Reg(asm.R1, asm.R0),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -20),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "deny"),
		asm.Mov.Reg(asm.R7, asm.R0),
		// The port, in host order.
		asm.LoadMem(asm.R8, asm.R6, ctxUserPort, asm.Word),
		asm.HostTo(asm.BE, asm.R8, asm.Half),
		// SOCK_STREAM (1) is ProtoTCP, SOCK_DGRAM (2) ProtoUDP.
		asm.LoadMem(asm.R9, asm.R6, ctxType, asm.Word),
		asm.JEq.Imm(asm.R9, 0, "deny"),
		asm.JGT.Imm(asm.R9, 2, "deny"),
	)
	for i := int16(0); i < MaxPortRules; i++ {
		next := fmt.Sprintf("rule%d", i+1)
		off := 4 + 8*i
		ins = append(ins,
			asm.LoadMem(asm.R1, asm.R7, 0, asm.Word).WithSymbol(fmt.Sprintf("rule%d", i)),
			asm.JLE.Imm(asm.R1, int32(i), "deny"),
			asm.LoadMem(asm.R2, asm.R7, off+4, asm.Byte),
			asm.And.Reg(asm.R2, asm.R9),
			asm.JEq.Imm(asm.R2, 0, next),
			asm.LoadMem(asm.R2, asm.R7, off, asm.Half),
			asm.JLT.Reg(asm.R8, asm.R2, next),
			asm.LoadMem(asm.R2, asm.R7, off+2, asm.Half),
			asm.JGT.Reg(asm.R8, asm.R2, next),
			asm.Ja.Label("allow"),
		)
	}
	return append(ins,
		asm.Mov.Imm(asm.R0, 0).WithSymbol(fmt.Sprintf("rule%d", MaxPortRules)),
		asm.Ja.Label("deny"),
		asm.Mov.Imm(asm.R0, 1).WithSymbol("allow"),
		asm.Return(),
		asm.Mov.Imm(asm.R0, 0).WithSymbol("deny"),
		asm.Return(),
	)
}

// newTrie makes a trie holding entries.
func newTrie(entries []Entry) (*ebpf.Map, error) {
	m, err := ebpf.NewMap(trieSpec())
	if err != nil {
		return nil, fmt.Errorf("create the allowlist map: %w", err)
	}
	for _, e := range entries {
		key := make([]byte, keySize)
		binary.NativeEndian.PutUint32(key, uint32(e.Prefix.Bits()))
		a := e.Prefix.Addr().As16()
		copy(key[4:], a[:])
		val := make([]byte, valueSize)
		binary.NativeEndian.PutUint32(val, uint32(len(e.Rules)))
		for i, r := range e.Rules {
			off := 4 + 8*i
			binary.NativeEndian.PutUint16(val[off:], r.Low)
			binary.NativeEndian.PutUint16(val[off+2:], r.High)
			val[off+4] = r.Protos
		}
		if err := m.Put(key, val); err != nil {
			m.Close()
			return nil, fmt.Errorf("fill the allowlist map: %w", err)
		}
	}
	return m, nil
}

// ApplyNetwork enforces entries on the cgroup2 directory cg: the first
// time by loading and attaching the programs, later by swapping the
// allowlist in place.
func ApplyNetwork(cg string, entries []Entry) error {
	dir, err := os.Open(cg)
	if err != nil {
		return fmt.Errorf("open the sandbox's cgroup: %w", err)
	}
	defer dir.Close()
	trie, err := newTrie(entries)
	if err != nil {
		return err
	}
	defer trie.Close()
	outer, err := attachedOuter(int(dir.Fd()))
	if err != nil {
		return err
	}
	if outer != nil {
		defer outer.Close()
		if err := outer.Put(uint32(0), trie); err != nil {
			return fmt.Errorf("swap in the new allowlist: %w", err)
		}
		return nil
	}
	outer, err = ebpf.NewMap(&ebpf.MapSpec{Name: "dsec_net", Type: ebpf.ArrayOfMaps, KeySize: 4, ValueSize: 4,
		MaxEntries: 1, InnerMap: trieSpec()})
	if err != nil {
		return fmt.Errorf("create the allowlist map: %w", notSupported(err))
	}
	defer outer.Close()
	if err := outer.Put(uint32(0), trie); err != nil {
		return fmt.Errorf("install the allowlist: %w", err)
	}
	var attached []ebpf.AttachType
	for _, at := range netAttach {
		v6 := at == ebpf.AttachCGroupInet6Connect || at == ebpf.AttachCGroupUDP6Sendmsg
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "dsec_egress", Type: ebpf.CGroupSockAddr, AttachType: at,
			Instructions: program(outer, v6), License: "GPL"})
		if err == nil {
			err = link.RawAttachProgram(link.RawAttachProgramOptions{Target: int(dir.Fd()), Program: prog, Attach: at})
			prog.Close()
		}
		if err != nil {
			for _, a := range attached {
				detach(int(dir.Fd()), a)
			}
			return fmt.Errorf("attach the egress allowlist (%s): %w", at, notSupported(err))
		}
		attached = append(attached, at)
	}
	return nil
}

func notSupported(err error) error {
	if errors.Is(err, ebpf.ErrNotSupported) {
		return fmt.Errorf("%v: %w", err, errdefs.ErrNotImplemented)
	}
	return err
}

// attachedOuter finds the allowlist of programs already attached to the
// cgroup (by a worker that may since have died), or nil.
func attachedOuter(cg int) (*ebpf.Map, error) {
	q, err := link.QueryPrograms(link.QueryOptions{Target: cg, Attach: netAttach[0]})
	if err != nil || len(q.Programs) == 0 {
		return nil, nil
	}
	prog, err := ebpf.NewProgramFromID(q.Programs[0].ID)
	if err != nil {
		return nil, fmt.Errorf("open the sandbox's egress program: %w", err)
	}
	defer prog.Close()
	info, err := prog.Info()
	if err != nil {
		return nil, err
	}
	ids, ok := info.MapIDs()
	if !ok || len(ids) != 1 {
		return nil, fmt.Errorf("the sandbox's egress program uses %d maps, not its allowlist's one: %w", len(ids), errdefs.ErrFailedPrecondition)
	}
	return ebpf.NewMapFromID(ids[0])
}

func detach(cg int, at ebpf.AttachType) {
	q, err := link.QueryPrograms(link.QueryOptions{Target: cg, Attach: at})
	if err != nil {
		return
	}
	for _, p := range q.Programs {
		if prog, err := ebpf.NewProgramFromID(p.ID); err == nil {
			link.RawDetachProgram(link.RawDetachProgramOptions{Target: cg, Program: prog, Attach: at})
			prog.Close()
		}
	}
}

// NetworkAttached says whether the cgroup carries the allowlist.
func NetworkAttached(cg string) bool {
	dir, err := os.Open(cg)
	if err != nil {
		return false
	}
	defer dir.Close()
	for _, at := range netAttach {
		q, err := link.QueryPrograms(link.QueryOptions{Target: int(dir.Fd()), Attach: at})
		if err != nil || len(q.Programs) == 0 {
			return false
		}
	}
	return true
}
