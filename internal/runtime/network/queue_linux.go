package network

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// A Queue is one netfilter queue bound by this process (nfnetlink_queue,
// the xt NFQUEUE target's other end): the packets the host's rules send
// to it wait in the kernel until this process gives each a verdict. A
// packet sent to a queue no process binds is dropped, never let through.
//
// Its socket is read by blocking calls, not through Go's poller: a
// queued packet waits on the read's wakeup, and the kernel waking the
// reading thread itself is one wakeup where the poller's is two.
type Queue struct {
	fd     int
	num    uint16
	seq    uint32
	buf    []byte
	closed atomic.Bool
	mu     sync.Mutex // held by a read: Close waits for it to end
}

// nfnetlink_queue's wire constants (linux/netfilter/nfnetlink_queue.h).
const (
	nfnlSubsysQueue = 3
	nfqnlMsgPacket  = 0
	nfqnlMsgVerdict = 1
	nfqnlMsgConfig  = 2

	nfqaPacketHdr  = 1
	nfqaVerdictHdr = 2
	nfqaMark       = 3
	nfqaPayload    = 10

	nfqaCfgCmd      = 1
	nfqaCfgParams   = 2
	nfqaCfgQueueMax = 3

	nfqnlCfgCmdBind = 1
	nfqnlCopyPacket = 2
)

// Netfilter verdicts.
const (
	nfDrop   = 0
	nfAccept = 1
	nfRepeat = 4
)

// QueuedPacket is a packet waiting for its verdict: its ID, its mark
// (0: none), and the packet from its network header on (valid until
// the next Read).
type QueuedPacket struct {
	ID     uint32
	Mark   uint32
	Packet []byte
}

// OpenQueue binds the queue num: unix.EPERM if another socket has it.
func OpenQueue(num uint16) (*Queue, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("nfnetlink: %w", err)
	}
	q := &Queue{fd: fd, num: num, buf: make([]byte, 1<<18)}
	if err := q.setup(); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("bind netfilter queue %d: %w", num, err)
	}
	return q, nil
}

func (q *Queue) setup() error {
	if err := unix.Bind(q.fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	// A burst past the buffer drops packets (sent again), not the queue;
	// a read waits a second at most, so Close is seen.
	unix.SetsockoptInt(q.fd, unix.SOL_NETLINK, unix.NETLINK_NO_ENOBUFS, 1)
	unix.SetsockoptInt(q.fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 4<<20)
	if err := unix.SetsockoptTimeval(q.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 1}); err != nil {
		return err
	}
	params := binary.BigEndian.AppendUint32(nil, 0xffff) // copy range: whole packets
	params = append(params, nfqnlCopyPacket)
	for _, attrs := range [][]netlink.Attribute{
		{{Type: nfqaCfgCmd, Data: []byte{nfqnlCfgCmdBind, 0, 0, unix.AF_INET}}},
		{{Type: nfqaCfgParams, Data: params}},
		{{Type: nfqaCfgQueueMax, Data: binary.BigEndian.AppendUint32(nil, 4096)}},
	} {
		if err := q.config(attrs); err != nil {
			return err
		}
	}
	return nil
}

// message is one netlink message of the queue's subsystem.
func (q *Queue) message(typ uint16, flags uint16, attrs []netlink.Attribute) ([]byte, error) {
	b, err := netlink.MarshalAttributes(attrs)
	if err != nil {
		return nil, err
	}
	q.seq++
	m := make([]byte, unix.NLMSG_HDRLEN, unix.NLMSG_HDRLEN+4+len(b))
	binary.NativeEndian.PutUint32(m[0:4], uint32(unix.NLMSG_HDRLEN+4+len(b)))
	binary.NativeEndian.PutUint16(m[4:6], nfnlSubsysQueue<<8|typ)
	binary.NativeEndian.PutUint16(m[6:8], unix.NLM_F_REQUEST|flags)
	binary.NativeEndian.PutUint32(m[8:12], q.seq)
	m = append(m, unix.AF_UNSPEC, 0) // struct nfgenmsg: family, version,
	m = binary.BigEndian.AppendUint16(m, q.num)
	return append(m, b...), nil
}

// config sends a config message and waits for its ack.
func (q *Queue) config(attrs []netlink.Attribute) error {
	m, err := q.message(nfqnlMsgConfig, unix.NLM_F_ACK, attrs)
	if err != nil {
		return err
	}
	if err := unix.Sendto(q.fd, m, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	for {
		n, _, err := unix.Recvfrom(q.fd, q.buf, 0)
		if err != nil {
			return err
		}
		for _, m := range parseMessages(q.buf[:n]) {
			if m.Header.Type == unix.NLMSG_ERROR && m.Header.Seq == q.seq && len(m.Data) >= 4 {
				if e := int32(binary.NativeEndian.Uint32(m.Data)); e != 0 {
					return unix.Errno(-e)
				}
				return nil
			}
		}
	}
}

// message is a netlink message as read.
type message struct {
	Header unix.NlMsghdr
	Data   []byte
}

// parseMessages splits b into its netlink messages. (Not
// syscall.ParseNetlinkMessage: a queued packet's message ends with the
// packet, unpadded, and it refuses a last message whose length is not
// a multiple of 4, and with it all the others.)
func parseMessages(b []byte) []message {
	var out []message
	for len(b) >= unix.NLMSG_HDRLEN {
		var m message
		m.Header.Len = binary.NativeEndian.Uint32(b[0:4])
		m.Header.Type = binary.NativeEndian.Uint16(b[4:6])
		m.Header.Flags = binary.NativeEndian.Uint16(b[6:8])
		m.Header.Seq = binary.NativeEndian.Uint32(b[8:12])
		l := int(m.Header.Len)
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			break
		}
		m.Data = b[unix.NLMSG_HDRLEN:l]
		out = append(out, m)
		b = b[min((l+3)&^3, len(b)):]
	}
	return out
}

// Read waits for the next packets (at least one): net.ErrClosed once
// the queue is closed.
func (q *Queue) Read() ([]QueuedPacket, error) {
	for {
		q.mu.Lock()
		if q.closed.Load() {
			q.mu.Unlock()
			return nil, net.ErrClosed
		}
		n, _, err := unix.Recvfrom(q.fd, q.buf, 0)
		q.mu.Unlock()
		switch {
		case errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) || errors.Is(err, unix.ENOBUFS):
			continue
		case err != nil:
			return nil, err
		}
		var out []QueuedPacket
		for _, m := range parseMessages(q.buf[:n]) {
			// (An error the kernel answered a verdict with, a packet
			// gone meanwhile, is not the queue's.)
			if m.Header.Type != nfnlSubsysQueue<<8|nfqnlMsgPacket || len(m.Data) < 4 {
				continue
			}
			ad, err := netlink.NewAttributeDecoder(m.Data[4:])
			if err != nil {
				continue
			}
			var p QueuedPacket
			hdr := false
			for ad.Next() {
				switch ad.Type() {
				case nfqaPacketHdr:
					if b := ad.Bytes(); len(b) >= 4 {
						p.ID, hdr = binary.BigEndian.Uint32(b), true
					}
				case nfqaMark:
					if b := ad.Bytes(); len(b) >= 4 {
						p.Mark = binary.BigEndian.Uint32(b)
					}
				case nfqaPayload:
					p.Packet = ad.Bytes()
				}
			}
			if hdr {
				out = append(out, p)
			}
		}
		if len(out) > 0 {
			return out, nil
		}
	}
}

// Verdict is a packet's verdict: accept or drop, or (Mark not 0)
// repeat, the packet carrying Mark through the hook's rules again.
type Verdict struct {
	ID     uint32
	Accept bool
	Mark   uint32
}

// Verdicts gives packets their verdicts, in one write.
func (q *Queue) Verdicts(vs []Verdict) error {
	var out []byte
	for _, v := range vs {
		verdict := uint32(nfDrop)
		switch {
		case v.Mark != 0:
			verdict = nfRepeat
		case v.Accept:
			verdict = nfAccept
		}
		attrs := []netlink.Attribute{{Type: nfqaVerdictHdr, Data: binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint32(nil, verdict), v.ID)}}
		if v.Mark != 0 {
			attrs = append(attrs, netlink.Attribute{Type: nfqaMark, Data: binary.BigEndian.AppendUint32(nil, v.Mark)})
		}
		m, err := q.message(nfqnlMsgVerdict, 0, attrs)
		if err != nil {
			return err
		}
		out = append(out, m...) // (each message is 4-byte aligned)
	}
	return unix.Sendto(q.fd, out, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
}

// Num is the queue's number.
func (q *Queue) Num() uint16 { return q.num }

// Close unbinds the queue (the kernel does, as the socket goes; it
// waits for a Read under way, a second at most): packets sent to it
// from then on are dropped.
func (q *Queue) Close() error {
	if q.closed.Swap(true) {
		return nil
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	return unix.Close(q.fd)
}
