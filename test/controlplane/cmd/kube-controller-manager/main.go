// Command kube-controller-manager is the upstream controller manager, built
// from k8s.io/kubernetes (the tests run only its endpointslice controller).
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() { os.Exit(cli.Run(app.NewControllerManagerCommand())) }
