package policy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/containerd/errdefs"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The network allowlist is enforced by four cgroup programs, connect4,
// connect6, sendmsg4 and sendmsg6, attached to each sandbox's cgroup2
// directory. They return 0 (EPERM) unless the sandbox's allowlist lets
// the destination through. One set of programs and two maps serve every
// sandbox a process makes: loading and verifying programs costs
// milliseconds, and so does any write to a map of maps (the kernel waits
// for an RCU grace period), so a sandbox costs a few map writes and four
// attachments, nothing more.
//
// The maps: gens, the caller's cgroup id -> the generation of its list
// now in force; and one LPM trie keyed by (cgroup id, generation,
// address as IPv6), IPv4 as IPv4-mapped IPv6 so an IPv6 socket to
// ::ffff:a.b.c.d meets the IPv4 rules. An update writes the new list
// under the next generation, flips gens with one write (a connect sees
// the old list or the new, never half of one), then deletes the old.
//
// The programs are attached with BPF_PROG_ATTACH and no flags: they stay
// with the cgroup without a pinned link or a process holding them (the
// worker may die; the sandbox runs on, and a later worker finds the maps
// through them), no program in a sub-cgroup can override them, and
// removing the cgroup detaches them. ReleaseNetwork drops a sandbox's
// entries before that.

var netAttach = []ebpf.AttachType{
	ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect,
	ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupUDP6Sendmsg,
}

const (
	keySize      = 4 + 8 + 4 + 16 // prefix length, cgroup id, generation, address
	keyFixedBits = (8 + 4) * 8
	valueSize    = 4 + 8*MaxPortRules
	maxSandboxes = 1 << 16
	trieCapacity = 1 << 20
)

// struct bpf_sock_addr offsets.
const (
	ctxUserIP4  = 4
	ctxUserIP6  = 8
	ctxUserPort = 24
	ctxType     = 32
)

// The stack of an allowlist check: the trie's key at fp-32 (its
// address, IPv6 or IPv4-mapped, at fp-16), the gens key at fp-40, the
// destination port (host order) at fp-44 and the protocol's bit
// (ProtoTCP, ProtoUDP) at fp-48.
const (
	fpKey   = -32
	fpAddr  = -16
	fpGen   = -40
	fpPort  = -44
	fpProto = -48
)

// program is the allowlist check for one cgroup hook (connect or
// sendmsg, IPv4 or IPv6): 1 lets the call through, 0 fails it (EPERM).
func program(gens, trie *ebpf.Map, v6 bool) asm.Instructions {
	ins := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		// SOCK_STREAM (1) is ProtoTCP, SOCK_DGRAM (2) ProtoUDP.
		asm.LoadMem(asm.R9, asm.R6, ctxType, asm.Word),
		asm.JEq.Imm(asm.R9, 0, "deny"),
		asm.JGT.Imm(asm.R9, 2, "deny"),
		asm.StoreMem(asm.RFP, fpProto, asm.R9, asm.Word),
		// The port, in host order.
		asm.LoadMem(asm.R8, asm.R6, ctxUserPort, asm.Word),
		asm.HostTo(asm.BE, asm.R8, asm.Half),
		asm.StoreMem(asm.RFP, fpPort, asm.R8, asm.Word),
	}
	if v6 {
		for i := int16(0); i < 4; i++ {
			ins = append(ins,
				asm.LoadMem(asm.R0, asm.R6, ctxUserIP6+4*i, asm.Word),
				asm.StoreMem(asm.RFP, fpAddr+4*i, asm.R0, asm.Word))
		}
	} else {
		ins = append(ins, mappedPrefix()...)
		ins = append(ins,
			asm.LoadMem(asm.R0, asm.R6, ctxUserIP4, asm.Word),
			asm.StoreMem(asm.RFP, fpAddr+12, asm.R0, asm.Word))
	}
	ins = append(ins,
		asm.FnGetCurrentCgroupId.Call(),
		asm.Mov.Reg(asm.R7, asm.R0),
	)
	return append(ins, check(gens, trie, 1, 0)...)
}

// mappedPrefix stores the first 12 bytes of an IPv4-mapped address
// (::ffff:) at fpAddr.
func mappedPrefix() asm.Instructions {
	return asm.Instructions{
		asm.StoreImm(asm.RFP, fpAddr, 0, asm.Word),
		asm.StoreImm(asm.RFP, fpAddr+4, 0, asm.Word),
		// bytes 00 00 ff ff
		asm.StoreImm(asm.RFP, fpAddr+8, int64(int32(binary.NativeEndian.Uint32([]byte{0, 0, 0xff, 0xff}))), asm.Word),
	}
}

// check looks the destination the stack holds up in the allowlist of
// the cgroup whose id is in R7, and returns allow if a rule lets its
// port and protocol through, deny otherwise (or where the code jumps
// to "deny" before it).
func check(gens, trie *ebpf.Map, allow, deny int32) asm.Instructions {
	ins := asm.Instructions{
		asm.StoreMem(asm.RFP, fpGen, asm.R7, asm.DWord),
		asm.LoadMapPtr(asm.R1, gens.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, fpGen),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "deny"),
		asm.LoadMem(asm.R8, asm.R0, 0, asm.Word),
		// The key: prefix length, cgroup id (as the host lays a u64
		// out), generation, address.
		asm.StoreImm(asm.RFP, fpKey, keySize*8-32, asm.Word),
		asm.StoreMem(asm.RFP, fpKey+4+4*lowWord(), asm.R7, asm.Word),
		asm.RSh.Imm(asm.R7, 32),
		asm.StoreMem(asm.RFP, fpKey+4+4*(1-lowWord()), asm.R7, asm.Word),
		asm.StoreMem(asm.RFP, fpKey+12, asm.R8, asm.Word),
		asm.LoadMapPtr(asm.R1, trie.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, fpKey),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "deny"),
		asm.Mov.Reg(asm.R7, asm.R0),
		asm.LoadMem(asm.R8, asm.RFP, fpPort, asm.Word),
		asm.LoadMem(asm.R9, asm.RFP, fpProto, asm.Word),
	}
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
		asm.Ja.Label("deny").WithSymbol(fmt.Sprintf("rule%d", MaxPortRules)),
		asm.Mov.Imm(asm.R0, allow).WithSymbol("allow"),
		asm.Return(),
		asm.Mov.Imm(asm.R0, deny).WithSymbol("deny"),
		asm.Return(),
	)
}

// lowWord is which 32-bit half of a u64 the host stores first.
func lowWord() int16 {
	if binary.NativeEndian.Uint16([]byte{1, 0}) == 1 {
		return 0
	}
	return 1
}

// progSet is a set of programs and the maps they read.
type progSet struct {
	gens, trie *ebpf.Map
	progs      map[ebpf.AttachType]*ebpf.Program
}

func (s *progSet) Close() {
	for _, p := range s.progs {
		p.Close()
	}
	s.gens.Close()
	s.trie.Close()
}

var (
	setMu  sync.Mutex
	shared *progSet
)

// sharedSet loads this process's programs, once.
func sharedSet() (*progSet, error) {
	setMu.Lock()
	defer setMu.Unlock()
	if shared != nil {
		return shared, nil
	}
	gens, err := ebpf.NewMap(&ebpf.MapSpec{Name: "dsec_net_gen", Type: ebpf.Hash, KeySize: 8, ValueSize: 4, MaxEntries: maxSandboxes})
	if err != nil {
		return nil, fmt.Errorf("create the allowlist map: %w", notSupported(err))
	}
	trie, err := ebpf.NewMap(&ebpf.MapSpec{Name: "dsec_net_allow", Type: ebpf.LPMTrie, KeySize: keySize, ValueSize: valueSize,
		MaxEntries: trieCapacity, Flags: unix.BPF_F_NO_PREALLOC})
	if err != nil {
		gens.Close()
		return nil, fmt.Errorf("create the allowlist map: %w", notSupported(err))
	}
	set := &progSet{gens: gens, trie: trie, progs: map[ebpf.AttachType]*ebpf.Program{}}
	for _, at := range netAttach {
		v6 := at == ebpf.AttachCGroupInet6Connect || at == ebpf.AttachCGroupUDP6Sendmsg
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "dsec_egress", Type: ebpf.CGroupSockAddr, AttachType: at,
			Instructions: program(gens, trie, v6), License: "GPL"})
		if err != nil {
			set.Close()
			return nil, fmt.Errorf("load the egress allowlist (%s): %w", at, notSupported(err))
		}
		set.progs[at] = prog
	}
	shared = set
	return set, nil
}

// attached finds the maps of the programs already on the cgroup (put
// there by this process or by a worker since dead), or nil.
func attached(cg int) (gens, trie *ebpf.Map, err error) {
	q, err := link.QueryPrograms(link.QueryOptions{Target: cg, Attach: netAttach[0]})
	if err != nil || len(q.Programs) == 0 {
		return nil, nil, nil
	}
	prog, err := ebpf.NewProgramFromID(q.Programs[0].ID)
	if err != nil {
		return nil, nil, fmt.Errorf("open the sandbox's egress program: %w", err)
	}
	defer prog.Close()
	info, err := prog.Info()
	if err != nil {
		return nil, nil, err
	}
	ids, _ := info.MapIDs()
	for _, id := range ids {
		m, err := ebpf.NewMapFromID(id)
		if err != nil {
			continue
		}
		switch m.Type() {
		case ebpf.Hash:
			gens = m
		case ebpf.LPMTrie:
			trie = m
		default:
			m.Close()
		}
	}
	if gens == nil || trie == nil {
		if gens != nil {
			gens.Close()
		}
		if trie != nil {
			trie.Close()
		}
		return nil, nil, fmt.Errorf("the sandbox's egress program does not read an allowlist: %w", errdefs.ErrFailedPrecondition)
	}
	return gens, trie, nil
}

// cgroupID is a cgroup2 directory's id: its inode number.
func cgroupID(dir *os.File) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(dir.Fd()), &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

func trieKey(cg uint64, gen uint32, e Entry) []byte {
	key := make([]byte, keySize)
	binary.NativeEndian.PutUint32(key, uint32(keyFixedBits+e.Prefix.Bits()))
	binary.NativeEndian.PutUint64(key[4:], cg)
	binary.NativeEndian.PutUint32(key[12:], gen)
	a := e.Prefix.Addr().As16()
	copy(key[16:], a[:])
	return key
}

func trieValue(e Entry) []byte {
	val := make([]byte, valueSize)
	binary.NativeEndian.PutUint32(val, uint32(len(e.Rules)))
	for i, r := range e.Rules {
		off := 4 + 8*i
		binary.NativeEndian.PutUint16(val[off:], r.Low)
		binary.NativeEndian.PutUint16(val[off+2:], r.High)
		val[off+4] = r.Protos
	}
	return val
}

// ApplyNetwork makes entries the allowlist of the cgroup2 directory cg,
// replacing old (the list in force there, if any): the first time by
// attaching the programs, later by flipping to a new generation.
func ApplyNetwork(cg string, old, entries []Entry) error {
	dir, err := os.Open(cg)
	if err != nil {
		return fmt.Errorf("open the sandbox's cgroup: %w", err)
	}
	defer dir.Close()
	id, err := cgroupID(dir)
	if err != nil {
		return err
	}
	gens, trie, err := attached(int(dir.Fd()))
	if err != nil {
		return err
	}
	fresh := gens == nil
	if fresh {
		set, err := sharedSet()
		if err != nil {
			return err
		}
		gens, trie = set.gens, set.trie
	} else {
		defer gens.Close()
		defer trie.Close()
	}
	var cur uint32
	if err := gens.Lookup(id, &cur); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("read the sandbox's allowlist: %w", err)
	}
	next := cur + 1
	for _, e := range entries {
		if err := trie.Put(trieKey(id, next, e), trieValue(e)); err != nil {
			for _, d := range entries {
				trie.Delete(trieKey(id, next, d))
			}
			return fmt.Errorf("write the allowlist: %w", err)
		}
	}
	if err := gens.Put(id, next); err != nil {
		return fmt.Errorf("switch to the new allowlist: %w", err)
	}
	for _, e := range old {
		trie.Delete(trieKey(id, cur, e))
	}
	if !fresh {
		return nil
	}
	set, _ := sharedSet()
	var done []ebpf.AttachType
	for _, at := range netAttach {
		if err := link.RawAttachProgram(link.RawAttachProgramOptions{Target: int(dir.Fd()), Program: set.progs[at], Attach: at}); err != nil {
			for _, a := range done {
				link.RawDetachProgram(link.RawDetachProgramOptions{Target: int(dir.Fd()), Program: set.progs[a], Attach: a})
			}
			dropEntries(gens, trie, id, next, entries)
			return fmt.Errorf("attach the egress allowlist (%s): %w", at, notSupported(err))
		}
		done = append(done, at)
	}
	return nil
}

func dropEntries(gens, trie *ebpf.Map, id uint64, gen uint32, entries []Entry) {
	gens.Delete(id)
	for _, e := range entries {
		trie.Delete(trieKey(id, gen, e))
	}
}

// ReleaseNetwork drops the allowlist entries of the cgroup2 directory
// cg, which is about to go (its programs go with it).
func ReleaseNetwork(cg string, entries []Entry) error {
	dir, err := os.Open(cg)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer dir.Close()
	id, err := cgroupID(dir)
	if err != nil {
		return err
	}
	gens, trie, err := attached(int(dir.Fd()))
	if err != nil || gens == nil {
		return err
	}
	defer gens.Close()
	defer trie.Close()
	var cur uint32
	if err := gens.Lookup(id, &cur); err != nil {
		return nil // nothing in force
	}
	dropEntries(gens, trie, id, cur, entries)
	return nil
}

func notSupported(err error) error {
	if errors.Is(err, ebpf.ErrNotSupported) {
		return fmt.Errorf("%v: %w", err, errdefs.ErrNotImplemented)
	}
	return err
}

// NetworkAttached says whether the cgroup carries the allowlist.
func NetworkAttached(cg string) bool { return attachedAll(cg, netAttach...) }

// attachedAll says whether the cgroup carries a program of every type.
func attachedAll(cg string, types ...ebpf.AttachType) bool {
	dir, err := os.Open(cg)
	if err != nil {
		return false
	}
	defer dir.Close()
	for _, at := range types {
		q, err := link.QueryPrograms(link.QueryOptions{Target: int(dir.Fd()), Attach: at})
		if err != nil || len(q.Programs) == 0 {
			return false
		}
	}
	return true
}

// A microVM's guest sends through a tap on the host, not through
// sockets of the sandbox's cgroup, so the cgroup programs never see its
// traffic: a tc program on the tap's ingress (what the guest sends)
// holds it to the same allowlist, the same maps under the same cgroup
// id, so policy apply changes it at once too. It passes ARP, checks the
// first segment of every TCP connection (SYN alone: the host's
// nftables table drops segments of connections it never saw open) and
// every UDP datagram, and drops the rest (IPv6, ICMP, fragments past the
// first, other protocols).

// struct __sk_buff's and the frame's offsets the tap program reads.
const (
	ethType  = 12 // the Ethernet frame's EtherType
	ipHeader = 14
	fpFrame  = -72 // 24 bytes of the frame, copied to the stack
)

// tapProgram is the allowlist check for the guest of the sandbox whose
// cgroup id is cg: TC_ACT_OK (0) or TC_ACT_SHOT (2).
func tapProgram(gens, trie *ebpf.Map, cg uint64) asm.Instructions {
	// load copies n bytes of the frame at offset off (or the register
	// offReg, if set) to the stack at fp.
	load := func(off int32, offReg asm.Register, fp int16, n int32) asm.Instructions {
		ins := asm.Instructions{asm.Mov.Reg(asm.R1, asm.R6)}
		if offReg != asm.R0 {
			ins = append(ins, asm.Mov.Reg(asm.R2, offReg))
		} else {
			ins = append(ins, asm.Mov.Imm(asm.R2, off))
		}
		return append(ins,
			asm.Mov.Reg(asm.R3, asm.RFP),
			asm.Add.Imm(asm.R3, int32(fp)),
			asm.Mov.Imm(asm.R4, n),
			asm.FnSkbLoadBytes.Call(),
			asm.JNE.Imm(asm.R0, 0, "deny"),
		)
	}
	ins := asm.Instructions{asm.Mov.Reg(asm.R6, asm.R1)}
	ins = append(ins, load(ethType, asm.R0, fpFrame, 2)...)
	ins = append(ins,
		asm.LoadMem(asm.R1, asm.RFP, fpFrame, asm.Half),
		asm.HostTo(asm.BE, asm.R1, asm.Half),
		asm.JEq.Imm(asm.R1, unix.ETH_P_ARP, "allow"),
		asm.JNE.Imm(asm.R1, unix.ETH_P_IP, "deny"),
	)
	ins = append(ins, load(ipHeader, asm.R0, fpFrame, 20)...)
	ins = append(ins,
		// A fragment past the first has no ports.
		asm.LoadMem(asm.R1, asm.RFP, fpFrame+6, asm.Half),
		asm.HostTo(asm.BE, asm.R1, asm.Half),
		asm.And.Imm(asm.R1, 0x1fff),
		asm.JNE.Imm(asm.R1, 0, "deny"),
		// The header's length, and where the ports are.
		asm.LoadMem(asm.R8, asm.RFP, fpFrame, asm.Byte),
		asm.And.Imm(asm.R8, 0x0f),
		asm.JLT.Imm(asm.R8, 5, "deny"),
		asm.LSh.Imm(asm.R8, 2),
		asm.Add.Imm(asm.R8, ipHeader),
		asm.LoadMem(asm.R1, asm.RFP, fpFrame+9, asm.Byte),
		asm.Mov.Imm(asm.R9, int32(ProtoUDP)),
		asm.JEq.Imm(asm.R1, unix.IPPROTO_UDP, "proto"),
		asm.Mov.Imm(asm.R9, int32(ProtoTCP)),
		asm.JNE.Imm(asm.R1, unix.IPPROTO_TCP, "deny"),
		asm.StoreMem(asm.RFP, fpProto, asm.R9, asm.Word).WithSymbol("proto"),
		// The destination, IPv4-mapped.
		asm.LoadMem(asm.R1, asm.RFP, fpFrame+16, asm.Word),
		asm.StoreMem(asm.RFP, fpAddr+12, asm.R1, asm.Word),
	)
	ins = append(ins, mappedPrefix()...)
	// The ports and, for TCP, the flags: 14 bytes from the transport
	// header's start.
	ins = append(ins, load(0, asm.R8, fpFrame, 14)...)
	ins = append(ins,
		asm.LoadMem(asm.R1, asm.RFP, fpFrame+2, asm.Half),
		asm.HostTo(asm.BE, asm.R1, asm.Half),
		asm.StoreMem(asm.RFP, fpPort, asm.R1, asm.Word),
		asm.JNE.Imm(asm.R9, int32(ProtoTCP), "check"),
		// Only a connection's opening (SYN without ACK) is checked.
		asm.LoadMem(asm.R1, asm.RFP, fpFrame+13, asm.Byte),
		asm.And.Imm(asm.R1, 0x12),
		asm.JNE.Imm(asm.R1, 0x02, "allow"),
		asm.LoadImm(asm.R7, int64(cg), asm.DWord).WithSymbol("check"),
	)
	return append(ins, check(gens, trie, 0, 2)...)
}

// ApplyTap holds what a microVM's guest sends through its tap, the host
// interface link, to the allowlist of its sandbox's cgroup2 directory cg
// (ApplyNetwork made it): a tc filter on the tap's ingress, which goes
// with the tap.
func ApplyTap(cg, ifname string) error {
	dir, err := os.Open(cg)
	if err != nil {
		return fmt.Errorf("open the sandbox's cgroup: %w", err)
	}
	defer dir.Close()
	id, err := cgroupID(dir)
	if err != nil {
		return err
	}
	gens, trie, err := attached(int(dir.Fd()))
	if err != nil {
		return err
	}
	if gens == nil {
		return fmt.Errorf("the sandbox's cgroup has no allowlist yet: %w", errdefs.ErrFailedPrecondition)
	}
	defer gens.Close()
	defer trie.Close()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "dsec_tap", Type: ebpf.SchedCLS, Instructions: tapProgram(gens, trie, id), License: "GPL"})
	if err != nil {
		return fmt.Errorf("load the guest's egress allowlist: %w", notSupported(err))
	}
	defer prog.Close() // the filter holds it
	l, err := netlink.LinkByName(ifname)
	if err != nil {
		return err
	}
	qdisc := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0),
		Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
	if err := netlink.QdiscAdd(qdisc); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("the guest's tap %s: clsact: %w", ifname, err)
	}
	filter := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.HANDLE_MIN_INGRESS,
		Handle: 1, Protocol: unix.ETH_P_ALL, Priority: 1}, Fd: prog.FD(), Name: "dsec_tap", DirectAction: true}
	if err := netlink.FilterAdd(filter); err != nil {
		return fmt.Errorf("the guest's tap %s: its filter: %w", ifname, err)
	}
	return nil
}
