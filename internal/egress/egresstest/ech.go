// Package egresstest holds what the egress tests share.
package egresstest

import (
	"crypto/ecdh"
	"crypto/rand"
	"encoding/binary"
)

// ECHConfigList is an ECHConfigList (draft-ietf-tls-esni, 4) with one
// made-up X25519 config whose public name is publicName: enough for Go's
// client to send an encrypted ClientHello.
func ECHConfigList(publicName string) []byte {
	k, err := ecdh.X25519().GenerateKey(rand.Reader)
	if err != nil {
		panic(err)
	}
	pub := k.PublicKey().Bytes()
	c := []byte{1, 0x00, 0x20} // config_id, DHKEM(X25519, HKDF-SHA256)
	c = binary.BigEndian.AppendUint16(c, uint16(len(pub)))
	c = append(c, pub...)
	c = append(c, 0, 4, 0, 1, 0, 1) // HKDF-SHA256, AES-128-GCM
	c = append(c, 0, byte(len(publicName)))
	c = append(c, publicName...)
	c = append(c, 0, 0) // extensions
	cfg := binary.BigEndian.AppendUint16([]byte{0xfe, 0x0d}, uint16(len(c)))
	cfg = append(cfg, c...)
	return append(binary.BigEndian.AppendUint16(nil, uint16(len(cfg))), cfg...)
}
